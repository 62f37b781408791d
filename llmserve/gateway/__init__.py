"""The gateway: one entry point in front of pools of `llmserve serve --no-platform` replicas.

`replica.py` is the gateway's view of one replica (health, load), `prefix_tree.py` the approximate
record of what each replica has cached, `routing.py` the policies that pick a replica per request."""

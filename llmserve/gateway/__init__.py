"""The gateway: one entry point in front of pools of `llmserve serve --no-platform` replicas.

`replica.py` is the gateway's view of one replica (health, load), `prefix_index.py` the approximate
record of what each replica has cached, `routing.py` the policies that pick a replica per request,
`pool.py` a model's replicas and their health checks, `proxy.py` the forwarding (retry, stream relay),
`app.py` the HTTP app, `metrics.py` its /metrics, `errors.py` its errors in OpenAI's shape, and
`serve.py` the `llmserve gateway` command."""

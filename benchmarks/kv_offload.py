"""The prefix cache's second tier: what loading evicted blocks back saves against computing them again.

Workload: `--docs` long documents (about `--doc-tokens` tokens each, distinct), and `--queries` requests,
each a document (chosen at random, or with `--order cycle` each in turn) followed by a short question of
its own, one request at a time; the KV
pool holds only `--pool-docs` documents' worth of blocks, so a document asked about again has usually
been evicted. Three engines, one per arm, are driven with the same requests in alternating order:
- `none`: no tier, an evicted document is computed again;
- `memory`: `kv_offload_gib`, the evicted blocks kept in host memory;
- `disk`: the same in files (`kv_offload_dir`, a temporary directory on this machine's disk).
Per arm: time to first token (one token asked: prefill only) over the requests, the prompt tokens computed,
and the blocks loaded from the tier. Then `restart`: a new engine on the disk arm's directory answers each
document once, its first sight of them, against a new engine without a tier computing them.

    python benchmarks/kv_offload.py [--size small] [--docs 12] [--queries 60] [--pool-docs 3]
        [--tensor-parallel-size 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.model.builtin import make_model
from llmserve.sampling.params import SamplingParams

BLOCK = 16
FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def engine(model_dir: Path, args: argparse.Namespace, **tier) -> LLMEngine:
    blocks = args.pool_docs * (args.doc_tokens // BLOCK + 2) + 8
    return LLMEngine(EngineConfig(model=str(model_dir), dtype=args.dtype, num_kv_blocks=blocks, block_size=BLOCK,
                                  max_model_len=args.doc_tokens + 64, max_num_batched_tokens=args.doc_tokens + 64,
                                  tensor_parallel_size=args.tensor_parallel_size, device="cpu", **tier))


def first_token_seconds(llm: LLMEngine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the request's first token, and the prompt tokens computed for it."""
    started = time.perf_counter()
    llm.add_request(request_id, prompt, FIRST_TOKEN)
    computed = 0
    while llm.has_unfinished_requests():
        llm.step()
        if llm.core.last_step is not None:
            computed += llm.core.last_step.num_prefill_tokens
            llm.core.last_step = None
    return time.perf_counter() - started, computed


def summary(times: list[float], computed: int, llm: LLMEngine) -> dict:
    stats = llm.stats()
    return {"requests": len(times), "ttft_ms_p50": round(statistics.median(times) * 1000, 1),
            "ttft_ms_mean": round(statistics.fmean(times) * 1000, 1), "prompt_tokens_computed": computed,
            "blocks_loaded": stats.kv_offload_loaded, "blocks_saved": stats.kv_offload_saved,
            "tier_mib": round(stats.kv_offload_bytes / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--doc-tokens", type=int, default=1000)
    ap.add_argument("--queries", type=int, default=60)
    ap.add_argument("--pool-docs", type=int, default=3, help="documents the KV pool holds at once")
    ap.add_argument("--tier-gib", type=float, default=4.0)
    ap.add_argument("--order", choices=("random", "cycle"), default="random",
                    help="cycle: the documents in turn, so that with --pool-docs 1 each is evicted before it comes back")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="ranks per engine (CPU processes): the tier gathers and scatters each rank's share")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    docs = [[rng.randrange(3, 8000) for _ in range(args.doc_tokens - 16)] for _ in range(args.docs)]
    order = [i % args.docs if args.order == "cycle" else rng.randrange(args.docs) for i in range(args.queries)]
    queries = [docs[d] + [rng.randrange(3, 8000) for _ in range(16)] for d in order]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / args.size, "llama", args.size, 0)
        disk_dir = Path(tmp) / "kv"
        tiers = {"none": {}, "memory": {"kv_offload_gib": args.tier_gib},
                 "disk": {"kv_offload_gib": args.tier_gib, "kv_offload_dir": str(disk_dir)}}
        # One process group per process: tensor-parallel engines run one after another, each arm whole.
        groups = [list(tiers)] if args.tensor_parallel_size == 1 else [[name] for name in tiers]
        result = {"workload": vars(args), "arms": {}}
        for names in groups:
            arms = {name: engine(model_dir, args, **tiers[name]) for name in names}
            times: dict[str, list[float]] = {name: [] for name in arms}
            computed = dict.fromkeys(arms, 0)
            for i, prompt in enumerate(queries):
                for name in (names if i % 2 == 0 else names[::-1]):
                    seconds, tokens = first_token_seconds(arms[name], f"q{i}", prompt)
                    times[name].append(seconds)
                    computed[name] += tokens
            for name, llm in arms.items():
                result["arms"][name] = summary(times[name], computed[name], llm)
                llm.core.shutdown()  # the disk arm's pool's blocks saved too
        cold: dict[str, list[float]] = {"none": [], "restart": []}
        restart_tiers = {"restart": tiers["disk"], "none": {}}
        for names in ([["restart", "none"]] if args.tensor_parallel_size == 1 else [["restart"], ["none"]]):
            engines = {name: engine(model_dir, args, **restart_tiers[name]) for name in names}
            for d, doc in enumerate(docs):
                for name in (names if d % 2 == 0 else names[::-1]):
                    cold[name].append(first_token_seconds(engines[name], f"cold{d}", doc + [5, 6, 7])[0])
            for llm in engines.values():
                llm.core.shutdown()
        result["restart"] = {f"{name}_ttft_ms_p50": round(statistics.median(values) * 1000, 1)
                             for name, values in cold.items()}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""The server against its own engine, in one run: `LLM.generate` (offline, the engine core in process)
against `llmserve serve` (the engine core in its own process) loaded by `llmserve bench serve` at
rate inf, on the same prompts, alternated round by round. Each side runs in fresh processes.

Default workload (issue 12's CPU proxy, where Python dominates): the tiny built-in Llama, 512
requests, input 32-128 tokens, output 64-128 tokens exactly (ignore_eos, min_tokens = max_tokens),
greedy. Reports output tok/s of both, their ratio, and the server's TTFT, TPOT and ITL.

    python benchmarks/serve_vs_offline.py --rounds 3 --json bench_out/serve_vs_offline.json
    python benchmarks/serve_vs_offline.py --model DIR --engine-args "--max-num-seqs 128" --server-only
    python benchmarks/serve_vs_offline.py --model 8B_DIR --engine-args "--load-format dummy" \
        --num-prompts 1000 --input-len 100:1024 --output-len 100:1024 --request-rate 8   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent


# ---- the offline side (a fresh process per round) ---------------------------------------------------
def offline_worker(args: argparse.Namespace) -> None:
    from llmserve import LLM, SamplingParams
    from llmserve.bench.datasets import LocalTokenizerSource, parse_len_range, random_dataset
    from llmserve.config import EngineConfig, add_engine_args, engine_config_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    engine_args = parser.parse_args(["--model", args.model, *shlex.split(args.engine_args)])
    llm = LLM(args.model, **engine_config_kwargs(engine_args))
    prompts, lengths = _workload(llm.get_tokenizer(), args, LocalTokenizerSource, random_dataset, parse_len_range)
    params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in lengths]
    llm.generate(prompts[:8], params[:8])  # warm-up, as the bench sends warm-up requests to the server
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(lengths)
    print(json.dumps({"output_tokens": produced, "seconds": seconds, "output_tok_s": produced / seconds,
                      "async_scheduling": EngineConfig(model=args.model, **engine_config_kwargs(engine_args))
                      .async_scheduling}))


def _workload(tokenizer, args, source_cls, random_dataset, parse_len_range) -> tuple[list[list[int]], list[int]]:
    """The prompts `llmserve bench serve --dataset random --prompt-format ids --seed S` sends."""
    conversations = random_dataset(source_cls(tokenizer), args.num_prompts, parse_len_range(args.input_len),
                                   parse_len_range(args.output_len), "ids", random.Random(args.seed))
    return [c.turns[0].user for c in conversations], [c.turns[0].output_len for c in conversations]


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--offline-worker", "--model", args.model, "--engine-args", args.engine_args,
               "--num-prompts", str(args.num_prompts), "--input-len", args.input_len, "--output-len", args.output_len,
               "--seed", str(args.seed)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- the server side ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_server(args: argparse.Namespace, out_dir: Path, label: str) -> dict[str, Any]:
    port = _free_port()
    command = [sys.executable, "-m", "llmserve.cli", "serve", "--model", args.model, "--port", str(port),
               "--no-platform", *shlex.split(args.engine_args), *shlex.split(args.serve_args)]
    log = open(out_dir / f"{label}-server.log", "w")  # noqa: SIM115 - closed below
    # Run from the tree's root: `python -m` puts the working directory first on the import path.
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=args.tree)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", server)
        result_path = out_dir / f"{label}.json"
        bench = [sys.executable, "-m", "llmserve.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                 "--tokenizer", args.model, "--dataset", "random", "--prompt-format", "ids",
                 "--random-input-len-range", args.input_len, "--random-output-len-range", args.output_len,
                 "--exact-output-len", "--num-prompts", str(args.num_prompts), "--request-rate", args.request_rate,
                 "--seed", str(args.seed), "--num-warmups", "8", "--no-progress", "--result-json", str(result_path)]
        subprocess.run(bench, check=True, capture_output=True, text=True)
        run = json.loads(result_path.read_text())["runs"][0]
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    return {"output_tok_s": run["output_throughput"], "completed": run["completed"], "failed": run["failed"],
            "ttft_p50_ms": run["ttft_ms"]["p50"], "tpot_p50_ms": run["tpot_ms"]["p50"],
            "itl_p50_ms": run["itl_ms"]["p50"], "itl_over_tpot": run["itl_ms"]["p50"] / run["tpot_ms"]["p50"]}


def _wait_healthy(base_url: str, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy")


# ---- the run ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the tiny built-in Llama)")
    ap.add_argument("--engine-args", default="--num-kv-blocks 8192", help="engine flags for both sides")
    ap.add_argument("--serve-args", default="", help="more flags for `llmserve serve` only")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", default="32:128")
    ap.add_argument("--output-len", default="64:128")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-rate", default="inf", help="the server's load (the offline side always gets all at once)")
    ap.add_argument("--rounds", type=int, default=3, help="offline then server, this many times")
    ap.add_argument("--server-only", action="store_true", help="no offline runs (e.g. a before/after of the server)")
    ap.add_argument("--tree", default=None, help="serve from this source tree, e.g. an older git worktree")
    ap.add_argument("--label", default="llmserve")
    ap.add_argument("--json", default=None)
    ap.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.model is None:
        from llmserve.model.builtin import ensure_default_model

        args.model = str(ensure_default_model("llama", "tiny"))
    if args.offline_worker:
        offline_worker(args)
        return {}
    out_dir = Path(tempfile.mkdtemp(prefix="serve-vs-offline-"))
    rounds = []
    for index in range(args.rounds):
        offline = None if args.server_only else run_offline(args)
        server = run_server(args, out_dir, f"{args.label}-{index}")
        ratio = None if offline is None else server["output_tok_s"] / offline["output_tok_s"]
        rounds.append({"offline": offline, "server": server, "server_over_offline": ratio})
        print(f"round {index + 1}: " + ("" if offline is None else f"offline {offline['output_tok_s']:.0f} tok/s, ")
              + f"server {server['output_tok_s']:.0f} tok/s" + ("" if ratio is None else f" ({ratio:.1%})")
              + f", TTFT p50 {server['ttft_p50_ms']:.0f} ms, TPOT p50 {server['tpot_p50_ms']:.2f} ms, "
              f"ITL p50 {server['itl_p50_ms']:.2f} ms (ITL/TPOT {server['itl_over_tpot']:.2f})", flush=True)
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "args": {k: v for k, v in vars(args).items() if k != "offline_worker"}, "rounds": rounds}
    ratios = [r["server_over_offline"] for r in rounds if r["server_over_offline"] is not None]
    result["median"] = {
        "server_output_tok_s": statistics.median(r["server"]["output_tok_s"] for r in rounds),
        "itl_over_tpot": statistics.median(r["server"]["itl_over_tpot"] for r in rounds),
        **({"offline_output_tok_s": statistics.median(r["offline"]["output_tok_s"] for r in rounds),
            "server_over_offline": statistics.median(ratios)} if ratios else {}),
    }
    print(json.dumps(result["median"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()

"""Per-step CPU overhead at batch 256 on the Llama-3.1-8B shape in bfloat16 (dummy weights).

With `batch` sequences all decoding, each engine step is timed end to end, and inside it the
scheduler's `schedule()`, input preparation (the engine's sampling plan, then the runner's
`prepare_step()`: input tensors and sampling metadata) and the runner's `run_step()` (forward pass and sampler on the GPU). The GPU part is bracketed by device
synchronisations, added only for this measurement; everything else in the step is host work after the
GPU finished (reading the ids, detokenising, stop checks). Goal: scheduling + input preparation
under 10% of the step.

    python benchmarks/gpu_overhead.py --json bench_out/gpu/overhead.json
    python benchmarks/gpu_overhead.py --smoke     # CPU, tiny model: checks the script, not the GPU
    python benchmarks/gpu_overhead.py --host-only [--temperature 0.8 --top-p 0.95]
        # CPU, tiny model, the full batch: the host parts in milliseconds (the forward is a stand-in)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from gpu_common import (
    bench_device,
    engine_args,
    machine_info,
    model_dir,
    print_table,
    random_prompts,
    synchronize,
    write_json,
)

from llmserve import LLM, SamplingParams
from llmserve.engine.llm_engine import LLMEngine

GOAL_PCT = 10.0


def _timed(target: Callable, sink: list[float], before: Callable[[], None] = lambda: None,
           after: Callable[[], None] = lambda: None) -> Callable:
    def wrapper(*args, **kwargs):
        before()
        start = time.perf_counter()
        out = target(*args, **kwargs)
        after()
        sink.append(time.perf_counter() - start)
        return out

    return wrapper


class _GcClock:
    """A gc callback adding up the time the cyclic collector runs (it can land in any part of a step)."""

    def __init__(self) -> None:
        self.total, self.count, self._start = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._start
            self.count += 1


def instrument(engine: LLMEngine) -> dict[str, list[float]]:
    """Wrap the engine's scheduler and runner so each step's parts land in the returned lists."""
    timings: dict[str, list[float]] = {"schedule": [], "sampling_plan": [], "prepare": [], "gpu": []}
    runner = engine.runner

    def sync() -> None:
        synchronize(runner.device)

    engine.scheduler.schedule = _timed(engine.scheduler.schedule, timings["schedule"])  # type: ignore[method-assign]
    engine._sampling_plan = _timed(engine._sampling_plan, timings["sampling_plan"])  # type: ignore[method-assign]
    runner.prepare_step = _timed(runner.prepare_step, timings["prepare"])  # type: ignore[method-assign]
    runner.run_step = _timed(runner.run_step, timings["gpu"], before=sync, after=sync)  # type: ignore[method-assign]
    return timings


def measure(engine: LLMEngine, batch: int, prompt_len: int, steps: int, warmup: int,
            temperature: float = 0.0, top_p: float = 1.0) -> dict[str, Any]:
    vocab = engine.tokenizer.vocab_size
    # The prompts take several steps to prefill, and the first ones decode meanwhile: leave them enough
    # tokens that none finishes inside the timed window.
    prefill_steps = -(-batch * prompt_len // engine.config.max_num_batched_tokens)
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=0,
                            max_tokens=prefill_steps + warmup + steps + 8, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, (prompt_len, prompt_len), vocab, seed=1)):
        engine.add_request(f"overhead-{i}", prompt, params)
    while any(seq.num_output_tokens == 0 for seq in engine.live_sequences()):
        engine.step()  # prefill every prompt
    for _ in range(warmup):
        engine.step()
    timings = instrument(engine)
    gc_seconds = _GcClock()
    gc.callbacks.append(gc_seconds)
    step_times, decodes = [], []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - start)
            decodes.append(engine.last_step.num_decodes if engine.last_step else 0)
    finally:
        gc.callbacks.remove(gc_seconds)
    if decodes != [batch] * steps:
        raise RuntimeError(f"expected {steps} pure decode steps of {batch} sequences, got {decodes}")
    ms = {name: statistics.fmean(values) * 1e3 for name, values in timings.items()}
    step_ms = statistics.fmean(step_times) * 1e3
    prepare_ms = ms["sampling_plan"] + ms["prepare"]
    other_ms = step_ms - ms["schedule"] - prepare_ms - ms["gpu"]
    return {
        "batch": batch, "steps": steps, "context_at_start": prompt_len + warmup + 1,
        "cuda_graphs": engine.runner.graphs is not None, "attention_backend": engine.runner.attn_backend.name,
        "step_ms": step_ms, "schedule_ms": ms["schedule"], "sampling_plan_ms": ms["sampling_plan"],
        "prepare_step_ms": ms["prepare"], "prepare_ms": prepare_ms, "gpu_ms": ms["gpu"], "other_host_ms": other_ms,
        "gc_ms": gc_seconds.total * 1e3 / steps, "gc_collections": gc_seconds.count / steps,
        "overhead_pct": 100 * (ms["schedule"] + prepare_ms) / step_ms,
        "all_host_pct": 100 * (step_ms - ms["gpu"]) / step_ms,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint or config-only dir (default: make-model --size 8b)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, a few sequences")
    ap.add_argument("--host-only", action="store_true",
                    help="tiny model on CPU at the full batch: the host parts' milliseconds, no GPU figure")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch, args.prompt_len, args.steps, args.warmup = 4, 8, 4, 1
        args.max_num_batched_tokens, args.max_model_len = 64, 128

    on_cpu = args.smoke or args.host_only
    device = bench_device(on_cpu)
    path = model_dir(args.model, on_cpu)
    overrides: dict[str, Any] = {}
    if args.host_only:  # the tiny model's context, and room for the whole batch's KV in the CPU pool
        args.max_model_len = min(args.max_model_len, 1024)
        overrides["num_kv_blocks"] = args.batch * -(-(args.prompt_len + 2 * (args.warmup + args.steps) + 64) // 16)
    llm = LLM(path, **engine_args(on_cpu, max_num_seqs=args.batch, max_model_len=args.max_model_len,
                                  max_num_batched_tokens=args.max_num_batched_tokens, **overrides))
    result: dict[str, Any] = {"model": path, "machine": machine_info(device), "args": vars(args)}
    result["run"] = measure(llm.engine, args.batch, args.prompt_len, args.steps, args.warmup,
                            args.temperature, args.top_p)
    result["goal"] = {"overhead_pct": GOAL_PCT, "measured": result["run"]["overhead_pct"],
                      "met": result["run"]["overhead_pct"] < GOAL_PCT}
    print_summary(result)
    write_json(args.json, result)
    return result


def print_summary(result: dict[str, Any]) -> None:
    r = result["run"]
    print_table(
        f"Per-step time at batch {r['batch']} (pure decode, mean of {r['steps']} steps, context ~{r['context_at_start']})",
        ["step ms", "schedule ms", "prepare inputs ms (sampling plan + runner)", "GPU forward+sample ms",
         "other host ms", "of it GC ms", "schedule+prepare % of step", "all host % of step"],
        [[f"{r['step_ms']:.2f}", f"{r['schedule_ms']:.2f}",
          f"{r['prepare_ms']:.2f} ({r['sampling_plan_ms']:.2f} + {r['prepare_step_ms']:.2f})", f"{r['gpu_ms']:.2f}",
          f"{r['other_host_ms']:.2f}", f"{r.get('gc_ms', 0.0):.2f}", f"{r['overhead_pct']:.1f}%",
          f"{r['all_host_pct']:.1f}%"]],
    )
    goal = result["goal"]
    print(f"\ngoal: scheduling + input preparation < {goal['overhead_pct']:.0f}% of the step: "
          f"{goal['measured']:.1f}% ({'met' if goal['met'] else 'not met'})")


if __name__ == "__main__":
    main()

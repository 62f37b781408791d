"""Per-step host work at batch 256 on the Llama-3.1-8B shape in bfloat16 (dummy weights), with
overlapped scheduling on and off, and the part of it the device waits for.

With `batch` sequences all decoding, each engine step is timed end to end (steady state: with
overlap on, one `LLMEngine.step()` launches step N+1 and applies step N) and split into
  - schedule: `Scheduler.schedule()`,
  - prepare: the plain step batch (`EngineCore.build_step_batch`) and the runner's device inputs
    (`ModelRunner.prepare_step`),
  - device: the forward pass and the sampler, from CUDA events recorded around each step's launches
    (no host sync added); on a CPU, the host's own time computing them,
  - apply: `Scheduler.update_from_output()` (tokens, stops, prefix-cache names),
  - outputs: the front end's output processor (detokenizing, stop strings, `RequestOutput`s).
"Host not hidden" is the step's wall time less its device time: what the device waits for the host.
Goal: under 10% of the step with overlap on.

    python benchmarks/gpu_overhead.py --json bench_out/gpu/overhead.json
    python benchmarks/gpu_overhead.py --smoke     # CPU, tiny model: checks the script, not the GPU
    python benchmarks/gpu_overhead.py --host-only [--temperature 0.8 --top-p 0.95]
        # CPU, tiny model, the full batch: the host parts in milliseconds (the forward is a stand-in, and
        # on a CPU the host is the device: nothing can hide behind it)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from gpu_common import (
    bench_device,
    engine_args,
    machine_info,
    model_dir,
    print_table,
    random_prompts,
    write_json,
)

from llmserve import LLM, SamplingParams
from llmserve.engine.llm_engine import LLMEngine

GOAL_PCT = 10.0
HOST_PARTS = ("schedule", "prepare", "apply", "outputs")


def _timed(target: Callable, sink: list[float]) -> Callable:
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = target(*args, **kwargs)
        sink.append(time.perf_counter() - start)
        return out

    return wrapper


class _DeviceClock:
    """Device time of each step: CUDA events recorded around its launches, read once at the end (no
    sync in the step); on a CPU, the host time of the forward pass and sampler."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.cpu_seconds: list[float] = []

    def wrap(self, run_step: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            if not self.cuda:
                start = time.perf_counter()
                out = run_step(*args, **kwargs)
                self.cpu_seconds.append(time.perf_counter() - start)
                return out
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            out = run_step(*args, **kwargs)
            end.record()
            self.events.append((begin, end))
            return out

        return wrapper

    def seconds(self) -> list[float]:
        if not self.cuda:
            return self.cpu_seconds
        torch.cuda.synchronize()
        return [begin.elapsed_time(end) / 1e3 for begin, end in self.events]


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


def instrument(engine: LLMEngine) -> tuple[dict[str, list[float]], _DeviceClock]:
    """Wrap the engine's parts so each step's timings land in the returned lists."""
    timings: dict[str, list[float]] = {name: [] for name in ("schedule", "batch", "prepare_step", "apply", "outputs")}
    core, runner = engine.core, engine.core.runner
    core.scheduler.schedule = _timed(core.scheduler.schedule, timings["schedule"])  # type: ignore[method-assign]
    core.build_step_batch = _timed(core.build_step_batch, timings["batch"])  # type: ignore[method-assign]
    runner.prepare_step = _timed(runner.prepare_step, timings["prepare_step"])  # type: ignore[method-assign]
    core.scheduler.update_from_output = _timed(  # type: ignore[method-assign]
        core.scheduler.update_from_output, timings["apply"])
    engine.output_processor.process = _timed(  # type: ignore[method-assign]
        engine.output_processor.process, timings["outputs"])
    clock = _DeviceClock(runner.device)
    runner.run_step = clock.wrap(runner.run_step)  # type: ignore[method-assign]
    return timings, clock


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
    while any(seq.num_output_tokens == 0 for seq in engine.core.live_sequences()):
        engine.step()  # prefill every prompt
    for _ in range(warmup):
        engine.step()
    timings, device = instrument(engine)
    gc_seconds = _GcClock()
    gc.callbacks.append(gc_seconds)
    step_times, decodes = [], []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - start)
            decodes.append(engine.core.last_step.num_decodes if engine.core.last_step else 0)
    finally:
        gc.callbacks.remove(gc_seconds)
    engine.abort_request([f"overhead-{i}" for i in range(batch)])
    if decodes != [batch] * steps:
        raise RuntimeError(f"expected {steps} pure decode steps of {batch} sequences, got {decodes}")
    ms = {name: statistics.fmean(values) * 1e3 for name, values in timings.items()}
    step_ms = statistics.fmean(step_times) * 1e3
    device_ms = statistics.fmean(device.seconds()) * 1e3
    hidden_gap_ms = max(0.0, step_ms - device_ms)
    return {
        "batch": batch, "steps": steps, "context_at_start": prompt_len + warmup + 1,
        "async_scheduling": engine.config.async_scheduling,
        "cuda_graphs": engine.core.runner.graphs is not None,
        "attention_backend": engine.core.runner.attn_backend.name,
        "step_ms": step_ms, "device_ms": device_ms,
        "schedule_ms": ms["schedule"], "prepare_ms": ms["batch"] + ms["prepare_step"],
        "batch_ms": ms["batch"], "prepare_step_ms": ms["prepare_step"],
        "apply_ms": ms["apply"], "outputs_ms": ms["outputs"],
        "host_ms": ms["schedule"] + ms["batch"] + ms["prepare_step"] + ms["apply"] + ms["outputs"],
        "gc_ms": gc_seconds.total * 1e3 / steps, "gc_collections": gc_seconds.count / steps,
        "host_not_hidden_ms": hidden_gap_ms,
        "host_not_hidden_pct": 100 * hidden_gap_ms / step_ms,
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
    ap.add_argument("--rounds", type=int, default=1, help="alternate overlap on and off this many times")
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
    result: dict[str, Any] = {"model": path, "machine": machine_info(device), "args": vars(args), "runs": []}
    engines = {
        overlap: LLM(path, **engine_args(on_cpu, max_num_seqs=args.batch, max_model_len=args.max_model_len,
                                         max_num_batched_tokens=args.max_num_batched_tokens,
                                         async_scheduling=overlap, **overrides)).engine
        for overlap in ((True, False) if not on_cpu or args.host_only else (True,))
    }
    for _ in range(args.rounds):
        for engine in engines.values():
            result["runs"].append(measure(engine, args.batch, args.prompt_len, args.steps, args.warmup,
                                          args.temperature, args.top_p))
    overlapped = [r["host_not_hidden_pct"] for r in result["runs"] if r["async_scheduling"]]
    measured = statistics.median(overlapped)
    result["goal"] = {"host_not_hidden_pct": GOAL_PCT, "measured": measured, "met": measured < GOAL_PCT,
                      "meaningful": device.type == "cuda"}
    print_summary(result)
    write_json(args.json, result)
    return result


def print_summary(result: dict[str, Any]) -> None:
    runs = result["runs"]
    r0 = runs[0]
    print_table(
        f"Per-step time at batch {r0['batch']} (pure decode, mean of {r0['steps']} steps, context ~{r0['context_at_start']})",
        ["overlap", "step ms", "device ms", "schedule ms", "prepare ms (batch + device inputs)", "apply ms",
         "outputs ms", "host ms in all", "of it GC ms", "host not hidden ms", "not hidden % of step"],
        [[("on" if r["async_scheduling"] else "off"), f"{r['step_ms']:.2f}", f"{r['device_ms']:.2f}",
          f"{r['schedule_ms']:.2f}", f"{r['prepare_ms']:.2f} ({r['batch_ms']:.2f} + {r['prepare_step_ms']:.2f})",
          f"{r['apply_ms']:.2f}", f"{r['outputs_ms']:.2f}", f"{r['host_ms']:.2f}", f"{r.get('gc_ms', 0.0):.2f}",
          f"{r['host_not_hidden_ms']:.2f}", f"{r['host_not_hidden_pct']:.1f}%"] for r in runs],
    )
    goal = result["goal"]
    note = "" if goal["meaningful"] else " (on a CPU the host is the device: only the host milliseconds mean anything)"
    print(f"\ngoal: host time not hidden behind the device < {goal['host_not_hidden_pct']:.0f}% of the step with "
          f"overlap on: {goal['measured']:.1f}% ({'met' if goal['met'] else 'not met'}){note}")


if __name__ == "__main__":
    main()

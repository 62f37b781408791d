"""The GPU benchmark scripts run end to end in their CPU smoke mode and print their tables;
`gpu.sh` refuses to run without CUDA."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))

    def load(name: str) -> ModuleType:
        return importlib.import_module(name)

    return load


def test_smoke_runs_print_tables_and_feed_the_summary(
    bench, tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    model = ["--smoke", "--model", str(tiny_llama_dir)]

    decode = bench("gpu_decode").main([*model, "--json", str(tmp_path / "decode.json")])
    printed = capsys.readouterr().out
    assert "| variant | mode | CUDA graphs | attention | KV dtype | KV pool tokens | ms/step |" in printed and "goal >= 85% of copy bandwidth (bf16)" in printed
    run = decode["runs"][0]
    assert (run["variant"], run["mode"], run["cuda_graphs"], run["steps"]) == ("bf16", "eager", False, 6)
    assert run["kv_pool_tokens"] == 256 * 16 and run["kv_cache_dtype"] == "float32"
    assert run["kv_bytes_per_step"] == (17 + 2 + 2.5) * 2 * 2 * 2 * 16 * 4  # mean context * layers * K,V * heads * dim * 4 B

    throughput = bench("gpu_throughput").main([*model, "--json", str(tmp_path / "throughput.json")])
    printed = capsys.readouterr().out
    assert "transformers generate, static batches of 2" in printed and "1 of 3 batches timed" in printed
    ours = throughput["llmserve"]
    assert ours["output_tokens"] == sum(bench("gpu_throughput").output_lengths(6, (2, 8), 0))
    assert throughput["transformers_static"]["extrapolated"] is True

    overhead = bench("gpu_overhead").main([*model, "--json", str(tmp_path / "overhead.json")])
    printed = capsys.readouterr().out
    assert "host not hidden ms" in printed
    [result] = overhead["runs"]
    assert (result["batch"], result["steps"], result["async_scheduling"]) == (4, 4, True)
    assert 0 < result["schedule_ms"] + result["prepare_ms"] + result["device_ms"] < result["step_ms"]

    parity = bench("gpu_parity").main([*model, "--json", str(tmp_path / "parity.json")])
    assert parity["passed"] and [r["identical"] for r in parity["runs"]] == [4, 4]
    assert "parity: passed" in capsys.readouterr().out

    (tmp_path / "steps.tsv").write_text("gpu-tests\t0\t12\nparity\t1\t30\ntriton-tests\tmissing\t0\n")
    assert bench("gpu_summary").main([str(tmp_path)]) == 0
    summary = capsys.readouterr().out
    assert "| gpu-tests | ok | 12 |" in summary and "| parity | FAILED (exit 1) | 30 |" in summary
    assert "| triton-tests | MISSING | 0 |" in summary
    assert summary.count("| met |") + summary.count("| NOT met |") == 4
    assert json.loads((tmp_path / "decode.json").read_text())["runs"][0]["mode"] == "eager"


def test_a_decode_variant_takes_its_suffixes_in_any_order(bench) -> None:
    gpu_decode = bench("gpu_decode")
    assert gpu_decode.split_variant("fp8-head-foldnorms-nopdl") == ("fp8-head", {"-foldnorms", "-nopdl"})
    assert gpu_decode.split_variant("bf16-foldrotary-foldnorms") == ("bf16", {"-foldnorms", "-foldrotary"})
    assert gpu_decode.split_variant("bf16-nopdl") == ("bf16", {"-nopdl"})
    assert gpu_decode.split_variant("int8") == ("int8", set())
    with pytest.raises(SystemExit, match="unknown variant 'fp4'"):
        gpu_decode.split_variant("fp4-foldnorms")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_gpu_sh_refuses_without_cuda(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OUT_DIR": str(tmp_path)}
    proc = subprocess.run(["bash", str(BENCHMARKS / "gpu.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "sees no CUDA device" in proc.stderr


def test_the_sass_report_sees_what_the_vector_width_changes(tmp_path: Path) -> None:
    """gpu_sass.py compiles the one-row kernel for sm_90 (in its own process: the kernel tests interpret
    theirs): with 1-byte weights loaded 16 at a time x's slice is reshuffled through shared memory
    (barriers in the loop); loaded 8 at a time, two slices ahead, it is not, and the loads issued before
    the first float instruction double."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sass.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_sass.py"), "--weights", "fp8", "--tiles", "8,1024,4",
                           "8,1024,4,1,2,8", "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sixteen, eight_ahead = json.loads(out.read_text())
    assert (sixteen["tiles"], eight_ahead["tiles"]) == ([8, 1024, 4, 1, 1, 16, 1], [8, 1024, 4, 1, 2, 8, 1])
    assert sixteen["barriers"] > 0 and eight_ahead["barriers"] == 0
    assert eight_ahead["weight_bytes_per_thread"] == 2 * sixteen["weight_bytes_per_thread"] == 128
    assert eight_ahead["bytes_before_first_float"] > sixteen["bytes_before_first_float"]

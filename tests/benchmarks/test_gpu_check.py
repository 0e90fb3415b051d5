"""The one-shot GPU check (benchmarks/gpu_check.sh) and its helpers, without a GPU: the probe's
no-CUDA mode, the summary's verdicts on hand-written results, and (with --slow) the whole script
in its --dry-run mode."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from imglora.plan.agreement import loss_agreement

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
GiB = 2**30


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_imglora_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def probe_mod() -> ModuleType:
    return _load("gpu_probe")


@pytest.fixture(scope="module")
def summary_mod() -> ModuleType:
    return _load("gpu_summary")


# ------------------------------------------------------------------------------------ probe


def test_probe_without_cuda_exits_0_and_writes_cuda_false(probe_mod, tmp_path, monkeypatch, capsys) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU machine
    out = tmp_path / "sub" / "probe.json"
    assert probe_mod.main(["--out", str(out)]) == 0
    assert "no CUDA device: probe skipped" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["cuda"] is False and data["torch"] == torch.__version__


def _probe_result(**over) -> dict:
    r = {"cuda": True, "probe_seconds": 12.3,
         "environment": {"gpu": "NVIDIA H200", "compute_capability": "9.0", "total_memory_bytes": 150 * GiB,
                         "driver": "999.1", "pcie": "5, 16", "cuda_runtime": "12.8", "torch": "2.13.0+cu128"},
         "bandwidth": {"bytes": 256 * 2**20, "repeats": 5,
                       **{k: {"gbps": 40.0, "gbps_wall": 39.0, "seconds": [0.0067]}
                          for k in ("h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable")}},
         "overlap": {"copy_seconds": 0.05, "compute_seconds": 0.05, "both_seconds": 0.06, "overlap_ratio": 0.8,
                     "matmuls": 300},
         "fp8": {"shape": "4096x3072 @ 3072x3072", "fp8_tensor_cores": True, "bf16_tflops": {"tflops": 500.0},
                 "scaled_mm": {"tflops": 900.0}, "scaled_mm_fast_accum": {"error": "RuntimeError: nope"},
                 "speedup_vs_bf16": 1.8}}
    r.update(over)
    return r


def test_probe_summary_formats_figures_and_errors(probe_mod) -> None:
    # Made-up numbers: only the formatting is checked (the GPU code paths need a GPU).
    text = probe_mod.summary(_probe_result())
    assert "NVIDIA H200" in text and "overlap ratio 0.80" in text and "RuntimeError: nope" in text
    broken = probe_mod.summary(_probe_result(bandwidth={"error": "OSError: no pinned memory"},
                                             overlap={"error": "x"}, fp8={"error": "y"}))
    assert "OSError: no pinned memory" in broken


def test_probe_guard_records_the_error_instead_of_raising(probe_mod) -> None:
    assert probe_mod._guard(lambda: 1 / 0) == {"error": "ZeroDivisionError: division by zero"}


class _FakeCuda:
    """torch.cuda as the probe uses it, on the CPU: events read the host clock, streams do nothing."""

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.t = None

        def record(self, stream=None) -> None:
            import time

            self.t = time.perf_counter()

        def synchronize(self) -> None:
            assert self.t is not None, "synchronize() on an event never recorded"

        def elapsed_time(self, end) -> float:
            assert self.t is not None and end.t is not None
            return (end.t - self.t) * 1e3  # ms, as CUDA events

    class Stream:
        def __init__(self, device=None) -> None:
            pass

        def wait_event(self, event) -> None:
            assert isinstance(event, _FakeCuda.Event)

    def __init__(self) -> None:
        self.slept = 0

    def current_device(self) -> int:
        return 0

    def current_stream(self, device=None):
        return _FakeCuda.Stream()

    def stream(self, s):
        import contextlib

        assert isinstance(s, _FakeCuda.Stream)
        return contextlib.nullcontext()

    def synchronize(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def _sleep(self, cycles: int) -> None:
        self.slept += 1

    def get_device_properties(self, device):
        from types import SimpleNamespace

        return SimpleNamespace(name="Fake GPU", total_memory=80 * GiB, multi_processor_count=132)

    def get_device_capability(self, device=None) -> tuple[int, int]:
        return (9, 0)

    def device_count(self) -> int:
        return 1


def _fake_torch(tuple_result: bool) -> object:
    """The real torch with CUDA mapped onto the CPU: tensors asked for on "cuda" or in pinned memory
    are plain CPU tensors; ``_scaled_mm`` checks the arguments as CUDA's does (fp8 operands, the
    second column-major, float32 scalar scales) and returns a tensor, or (out, amax) like torch < 2.4."""
    import torch

    def cpu(fn):
        def wrapped(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            kwargs.pop("device", None)
            return fn(*args, **kwargs)
        return wrapped

    def scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        assert a.dtype == b.dtype == torch.float8_e4m3fn and b.stride(0) == 1, "mat2 must be column-major fp8"
        assert scale_a.dtype == scale_b.dtype == torch.float32 and scale_a.numel() == 1
        out = (a.float() @ b.float() * scale_a * scale_b).to(out_dtype)
        return (out, torch.zeros(())) if tuple_result else out

    class Fake:
        cuda = _FakeCuda()
        version = SimpleNamespace(cuda="12.8")
        empty, randn, ones = (staticmethod(cpu(f)) for f in (torch.empty, torch.randn, torch.ones))
        _scaled_mm = staticmethod(scaled_mm)

        @staticmethod
        def device(*args, **kwargs):
            return torch.device("cpu")

        def __getattr__(self, name):
            return getattr(torch, name)

    return Fake()


@pytest.mark.parametrize("tuple_result", [False, True], ids=["torch>=2.4", "torch<2.4"])
def test_probe_cuda_code_runs_against_a_cpu_stand_in(probe_mod, monkeypatch, tuple_result) -> None:
    """Every CUDA section of the probe, run with CUDA mapped onto the CPU and shrunk sizes: the
    code's plumbing (calls, keys, arithmetic, the summary), not any figure."""
    monkeypatch.setattr(probe_mod, "OVERLAP_MATMUL", 64)
    monkeypatch.setattr(probe_mod, "OVERLAP_COPIES", 2)
    monkeypatch.setattr(probe_mod, "FP8_SHAPE", (64, 32, 48))
    monkeypatch.setattr(probe_mod, "MATMUL_ITERS", 2)
    monkeypatch.setattr(probe_mod, "ATTN_SHAPE", (1, 2, 64, 16))
    fake = _fake_torch(tuple_result)
    r = probe_mod.probe(fake, 2**20, 2)
    for section in ("environment", "bandwidth", "overlap", "fp8", "attention"):
        assert "error" not in r[section], (section, r[section])
    assert r["environment"]["gpu"] == "Fake GPU" and r["environment"]["compute_capability"] == "9.0"
    assert set(r["bandwidth"]) >= {"h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable"}
    assert all(r["bandwidth"][k]["gbps"] > 0 for k in ("h2d_pinned", "d2h_pageable"))
    assert r["overlap"]["matmuls"] >= 10 and r["overlap"]["copy_seconds"] > 0 and fake.cuda.slept > 0
    f = r["fp8"]
    assert f["fp8_tensor_cores"] and f["scaled_mm"]["tflops"] > 0 and f["scaled_mm_fast_accum"]["tflops"] > 0
    assert f["scaled_mm"]["max_rel_error_vs_bf16_of_fp8_inputs"] < 0.02 and f["speedup_vs_bf16"] > 0
    a = r["attention"]
    assert a["shape"] == [1, 2, 64, 16] and "flash" in a["default_order"]
    for name in ("flash", "math_bf16"):  # the CPU has these two; bf16 against the float32 reference
        assert a[name]["finite"] and 0 < a[name]["max_rel_error"] < 0.05, (name, a[name])
        assert set(a[name]["errors"]) == {"out", "grad_q", "grad_k", "grad_v"} and a[name]["ms_forward_backward"] > 0
    assert "error" in a["cudnn"]  # no cuDNN attention on the CPU: recorded, the others still measured
    text = probe_mod.summary(r)
    assert "Fake GPU" in text and "torch._scaled_mm fp8" in text
    assert "attention 1x2x64x16 (bf16, forward + backward, against math kernel, float32)" in text
    assert any(line.strip().startswith("flash") and "finite, largest relative error" in line
               for line in text.splitlines())
    json.dumps(r)  # the JSON the check writes


# ------------------------------------------------------------------------------------ summary


def _result(setting: str, spu: float, peak: int | None, status: str = "ok", device: str = "cuda") -> dict:
    if status != "ok":
        return {"setting": setting, "status": status, "stage": "forward", "error": "CUDA out of memory. Tried"}
    return {"setting": setting, "status": "ok", "device": device,
            "sec_per_update": {"median": spu, "mean": spu, "p10": spu, "p90": spu, "n": 8, "warmup": 3},
            "peak_allocated": peak, "peak_reserved": peak, "peak_rss": 20 * GiB, "h2d_bytes_per_update": 2**30,
            "setup_seconds": 30.0, "losses": [0.5, 0.4375, 0.625, 0.5]}


def _write_inputs(folder: Path, results: list[dict], *, plan: bool = True, pytest_rc: int = 0,
                  failures: int = 0, cuda: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    bench = folder / "bench-flux"
    bench.mkdir()
    (bench / "bench.json").write_text(json.dumps({
        "preset": "presets/flux.toml", "arch": "full", "resolution": 1024, "steps": 8, "warmup": 3,
        "results": results, "loss_agreement": loss_agreement(results),
        "environment": {"device_name": "NVIDIA H200", "torch": "2.13.0"}}))
    (folder / "probe.json").write_text(json.dumps(_probe_result() if cuda else {"cuda": False}))
    if plan:
        (folder / "plan.json").write_text(json.dumps({"settings": [
            {"setting": "fp8:18", "precision": "fp8", "blocks_to_swap": 18, "device_peak_bytes": 8 * GiB,
             "host_peak_bytes": 9 * GiB, "terms": {"weights": 6 * GiB, "activations": 2 * GiB}},
            {"setting": "fp8:0", "precision": "fp8", "blocks_to_swap": 0, "device_peak_bytes": 14 * GiB,
             "host_peak_bytes": 3 * GiB, "terms": {"weights": 12 * GiB}}], "fastest_fit": "fp8:18"}))
    (folder / "pytest-gpu.xml").write_text(
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="12" failures="{failures}" '
        f'errors="0" skipped="1"></testsuite></testsuites>')
    (folder / "steps.tsv").write_text(f"env\tok\t0\t5\tpython 3.12\nprobe\tok\t0\t20\t\n"
                                      f"pytest\t{'ok' if pytest_rc == 0 else 'failed'}\t{pytest_rc}\t60\t\n"
                                      "bench\tok\t0\t150\t\n" +
                                      ("plan\tok\t0\t5\t\n" if plan else
                                       "plan\tskipped\t\t0\timglora plan not available\n"))
    return folder


def _run(summary_mod, folder: Path, *extra: str) -> tuple[int, str, str, dict[str, str]]:
    """(exit status, text, Markdown, {target key: verdict}) of the summary of ``folder``."""
    args = summary_mod.parse_args([
        "--probe", str(folder / "probe.json"), "--bench", str(folder / "bench-flux" / "bench.json"),
        "--plan", str(folder / "plan.json"), "--junit", str(folder / "pytest-gpu.xml"),
        "--steps", str(folder / "steps.tsv"), *extra])
    text, md, rc, rows = summary_mod.render(args)
    keys = {v: k for k, v in summary_mod.TARGETS.items()}
    return rc, text, md, {keys[r["target"]]: r["verdict"] for r in rows}


def test_summary_all_targets_pass_with_the_plan_next_to_the_peaks(summary_mod, tmp_path) -> None:
    folder = _write_inputs(tmp_path / "c", [_result("fp8:0", 0.50, 14 * GiB), _result("fp8:18", 0.52, 8 * GiB)])
    rc, text, md, v = _run(summary_mod, folder)
    assert rc == 0 and "ALL TARGETS PASS" in text
    assert v == {"peak": "PASS", "speed": "PASS", "ratio": "PASS", "losses": "PASS", "tests": "PASS"}
    assert "8.00 GiB (measured / plan 1.00)" in text and "plan predicts 8.00 GiB" in text
    assert "| fp8 + 18 swapped blocks: peak allocated < 10 GiB | 8.00 GiB (measured / plan 1.00) | 8.00 GiB | PASS |" in md
    assert "| fp8:18 | ok | 0.520 |" in md and "| 8.00 | 9.00 |" in md  # plan device / host peaks per setting
    assert "fastest setting that fits: `fp8:18`" in md and "Plan terms for `fp8:18`: weights 6.00 GiB" in md
    assert "NVIDIA H200" in md and "DRY RUN" not in md


def test_summary_shows_what_the_auto_prefetch_chose(summary_mod, tmp_path) -> None:
    swapped = _result("fp8:18", 0.52, 8 * GiB)
    swapped["swap"] = {"prefetch": {"auto": True, "depth": 3, "extra_device_bytes": GiB // 2,
                                    "copy_ms": {"0": 6.8, "1": 2.9}, "compute_ms": {"0": 3.9, "1": 1.6},
                                    "forward_stall_ms": {"1": 21.4, "2": 9.1, "3": 0.4}}}
    folder = _write_inputs(tmp_path / "p", [_result("fp8:0", 0.50, 14 * GiB), swapped])
    _, text, md, _ = _run(summary_mod, folder)
    line = ("fp8:18: prefetch 3 block(s) ahead (auto); +0.50 GiB of slots; copy ms 0: 6.8, 1: 2.9; "
            "compute ms 0: 3.9, 1: 1.6; forward stall ms by depth 1: 21.4, 2: 9.1, 3: 0.4")
    assert f"  {line}" in text.splitlines() and f"- {line}" in md.splitlines()
    assert "fp8:0: prefetch" not in text  # no swap, nothing to say


def test_summary_lists_each_figure_the_check_records(summary_mod, tmp_path) -> None:
    swapped = _result("fp8:18", 0.52, 8 * GiB)
    swapped.update(
        profiled_update={"forward": 0.125, "backward": 0.375, "optimizer": 0.0125, "total": 0.5125},
        setup_peak_allocated=6 * GiB, setup_peak_reserved=7 * GiB,
        swap_copies={"loads_per_update": 54.0, "stalls_per_update": 2.0},
        swap={"host_memory": {"registered": 5 * GiB}, "prefetch": {"depth": 1, "forward_compute_ms": 230.25}},
        offload_checkpoints={"moves": True, "host_memory": {"registered": 3 * GiB // 2}})
    folder = _write_inputs(tmp_path / "d", [_result("fp8:0", 0.50, 14 * GiB), swapped])
    _, text, md, _ = _run(summary_mod, folder)
    line = ("fp8:18: profiled update: forward 0.125 s, backward 0.375 s, optimizer 0.013 s, total 0.512 s; "
            "set-up peak 6.00 allocated / 7.00 reserved GiB (reset before training); 54.0 block copies per "
            "update, 2.0 of them stalls; host memory: swapped blocks registered 5.00 GiB, boundaries registered "
            "1.50 GiB; forward compute, all blocks: 230.2 ms (estimate 134.9 ms)")
    assert f"  {line}" in text.splitlines() and f"- {line}" in md.splitlines()
    assert not any(x.startswith("  fp8:0:") for x in text.splitlines())  # nothing recorded for it here


def test_summary_fails_each_target_it_misses(summary_mod, tmp_path) -> None:
    folder = _write_inputs(tmp_path / "c", [_result("fp8:0", 0.50, 14 * GiB), _result("fp8:18", 0.70, 11 * GiB)],
                           pytest_rc=1, failures=2)
    rc, text, md, v = _run(summary_mod, folder)
    assert rc == 1 and "4 FAIL" in text
    assert v == {"peak": "FAIL", "speed": "FAIL", "ratio": "FAIL", "losses": "PASS", "tests": "FAIL"}
    assert "1.400 (0.700 / 0.500 s)" in text and "2 failed" in text


def test_summary_fails_losses_that_are_not_finite_or_differ(summary_mod, tmp_path) -> None:
    # As on the first H200 run: the first update's loss finite, NaN from the second on.
    nan = _result("fp8:18", 0.52, 8 * GiB)
    nan["losses"] = [3.382047, float("nan"), float("nan"), float("nan")]
    folder = _write_inputs(tmp_path / "n", [_result("fp8:0", 0.50, 14 * GiB), nan])
    rc, text, md, v = _run(summary_mod, folder)
    assert rc == 1 and v["losses"] == "FAIL" and v["speed"] == "PASS"  # the timing is there; it measures nothing
    assert "fp8:18: loss nan at update 2 of 4" in text
    assert "| fp8:18 | ok, loss NaN from update 2 | 0.520 |" in md
    # finite but another computation: the same weights and seeds must give the same losses
    off = _result("fp8:18", 0.52, 8 * GiB)
    off["losses"] = [0.5, 0.4375, 0.7, 0.5]
    folder = _write_inputs(tmp_path / "d", [_result("fp8:0", 0.50, 14 * GiB), off])
    rc, text, _, v = _run(summary_mod, folder)
    assert rc == 1 and v["losses"] == "FAIL" and "DIFFER" in text and "largest relative difference 1.20e-01" in text


def test_summary_a_setting_that_ran_out_of_memory(summary_mod, tmp_path) -> None:
    folder = _write_inputs(tmp_path / "c", [_result("fp8:0", 0.50, 14 * GiB), _result("fp8:18", 0, None, "oom")])
    rc, text, _, v = _run(summary_mod, folder)
    assert rc == 1
    assert (v["peak"], v["speed"], v["ratio"]) == ("FAIL", "NOT MEASURED", "NOT MEASURED")
    assert "fp8:18: oom at stage forward" in text


def test_summary_reports_each_diagnosis_run(summary_mod, tmp_path) -> None:
    """The diagnose step's runs, as the summary reads them: a math-kernel run whose losses stay finite
    (the fused kernel to blame) and a launch-blocking run that anomaly detection stopped, named."""
    (tmp_path / "diagnose-math").mkdir()
    (tmp_path / "diagnose").mkdir()
    (tmp_path / "diagnose-math" / "bench.json").write_text(json.dumps({"results": [
        {"setting": "fp8:18", "status": "ok", "losses": [3.382047, 3.1, 2.9]}]}))
    (tmp_path / "diagnose" / "bench.json").write_text(json.dumps({"results": [
        {"setting": "fp8:18", "status": "error", "stage": "update 1: backward",
         "error": "Function 'ScaledDotProductFlashAttentionBackward0' returned nan values in its 0th output."}]}))
    lines = summary_mod.diagnosis_lines(tmp_path)
    assert lines == [
        "math attention kernel, asynchronous, fp8:18: losses [3.382047, 3.100000, 2.900000] all finite",
        "CUDA_LAUNCH_BLOCKING=1 with autograd anomaly detection, fp8:18: error in update 1: backward: Function "
        "'ScaledDotProductFlashAttentionBackward0' returned nan values in its 0th output."]
    (tmp_path / "diagnose-math" / "bench.json").write_text(json.dumps({"results": [
        {"setting": "fp8:18", "status": "ok", "losses": [3.38, float("nan")]}]}))
    assert summary_mod.diagnosis_lines(tmp_path)[0] == (
        "math attention kernel, asynchronous, fp8:18: losses [3.380000, nan] NOT FINITE: loss nan at update 2 of 2")
    assert summary_mod.diagnosis_lines(tmp_path / "nothing") == [] and summary_mod.diagnosis_lines(None) == []


def test_summary_without_plan_says_so_and_still_judges(summary_mod, tmp_path) -> None:
    folder = _write_inputs(tmp_path / "c", [_result("fp8:0", 0.50, 14 * GiB), _result("fp8:18", 0.52, 8 * GiB)],
                           plan=False)
    rc, text, md, v = _run(summary_mod, folder)
    assert rc == 0 and v["peak"] == "PASS"
    assert "plan: not available (imglora plan not available); predictions left blank" in text
    assert "| 8.00 GiB | — | PASS |" in md  # no prediction next to the measured peak


def test_summary_of_a_bench_stopped_before_bench_json(summary_mod, tmp_path) -> None:
    folder = _write_inputs(tmp_path / "c", [])
    (folder / "bench-flux" / "bench.json").unlink()
    for i, (setting, result) in enumerate([("fp8:0", _result("fp8:0", 0.5, 14 * GiB)), ("fp8:18", None)], 1):
        d = folder / "bench-flux" / f"setting-{i}"
        d.mkdir()
        precision, _, blocks = setting.partition(":")
        (d / "spec.json").write_text(json.dumps({"precision": precision, "blocks": int(blocks)}))
        if result:
            (d / "result.json").write_text(json.dumps({k: v for k, v in result.items() if k != "setting"}))
    rc, text, _, v = _run(summary_mod, folder)
    assert rc == 1 and "stopped before bench.json was written" in text
    assert "fp8:18: unfinished" in text and "| fp8:0" not in text  # text table, not markdown


def test_summary_dry_run_measures_nothing(summary_mod, tmp_path) -> None:
    folder = _write_inputs(tmp_path / "c", [_result("fp8:0", 0.1, None, device="cpu"),
                                            _result("fp8:4", 0.12, None, device="cpu")], plan=False, cuda=False)
    rc, text, md, v = _run(summary_mod, folder, "--dry-run", "--swapped", "fp8:4")
    assert rc == 0 and "DRY RUN" in text and "PASS" not in text and "FAIL" not in text
    assert set(v.values()) == {"not measured (no GPU)"}
    assert md.count("| not measured (no GPU) |") == 5 and "fp8:4 stands in for fp8:18" in md


def test_summary_main_writes_markdown_and_needs_no_inputs(summary_mod, tmp_path, capsys) -> None:
    md = tmp_path / "out" / "summary.md"
    rc = summary_mod.main(["--md", str(md), "--probe", str(tmp_path / "none.json")])
    assert rc == 1  # nothing measured on what claims to be a GPU run
    assert md.is_file() and all(t in md.read_text() for t in summary_mod.TARGETS.values())


# ------------------------------------------------------------------------------------ script


def test_script_parses_and_refuses_unknown_arguments() -> None:
    assert subprocess.run(["bash", "-n", str(BENCH / "gpu_check.sh")]).returncode == 0
    r = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown argument: --bogus" in r.stderr


def _script_env() -> dict[str, str]:
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    # this checkout's imglora, whatever is installed
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])])
    return env


@pytest.mark.slow
def test_dry_run_runs_every_step_and_names_each_target(tmp_path) -> None:
    out = tmp_path / "check"
    r = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), "--dry-run", "--out", str(out)], cwd=tmp_path,
                       env=_script_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    md = (out / "summary.md").read_text()
    for target in ("fp8 + 18 swapped blocks: peak allocated < 10 GiB",
                   "fp8 + 18 swapped blocks: seconds per update <= 0.6 s",
                   "fp8:18 / fp8:0 seconds per update <= 1.05", "GPU tests (pytest -m gpu) pass"):
        assert target in md
    assert "DRY RUN" in md and md.count("| not measured (no GPU) |") == 5 and "| PASS |" not in md
    steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    status = {s[0]: s[1] for s in steps}
    assert status["env"] == status["probe"] == status["pytest"] == status["bench"] == "ok"
    assert status["plan"] in ("ok", "skipped")
    assert status["diagnose"] == "skipped"  # every setting finished with finite losses
    assert "the bench found nothing to diagnose" in (out / "steps.tsv").read_text()
    assert json.loads((out / "probe.json").read_text())["cuda"] is False
    bench = json.loads((out / "bench-flux" / "bench.json").read_text())
    assert [x["setting"] for x in bench["results"]] == ["fp8:4", "fp8:0", "fp8c:4"]  # the swapped one first
    assert all(x["status"] == "ok" for x in bench["results"])
    assert "no CUDA device: probe skipped" in (out / "check.log").read_text()


@pytest.mark.slow
def test_dry_run_on_the_cuda_standin_takes_the_cuda_paths(tmp_path) -> None:
    """The check's bench and plan steps with every Python process on the CUDA stand-in
    (tests/standin_site): bench-swap's workers run block swap and offloaded boundaries on their
    streams, with random copy latencies, and no process sees an ordering violation. (The probe and
    the gpu tests make real CUDA tensors; their CUDA code is rehearsed by the probe's own test.)"""
    out, reports = tmp_path / "check", tmp_path / "standin"
    env = _script_env()
    env.update(IMGLORA_CUDA_STANDIN="7", IMGLORA_CUDA_STANDIN_REPORT=str(reports), GPU_CHECK_STEPS="bench plan",
               GPU_CHECK_BLOCKS="fp8:4,fp8:0,fp8c:4",  # fp8 compute too, as a GPU_CHECK_BLOCKS run adds it
               PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "standin_site"), env["PYTHONPATH"]]))
    r = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), "--dry-run", "--out", str(out)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    status = {s.split("\t")[0]: s.split("\t")[1] for s in (out / "steps.tsv").read_text().splitlines()}
    assert status == {"env": "ok", "bench": "ok", "pytest": "skipped", "probe": "skipped", "diagnose": "skipped",
                      "plan": "ok"}
    seen = [json.loads(f.read_text()) for f in reports.glob("*.json")]
    assert seen and all(s["violations"] == [] for s in seen)
    workers = {Path(s["argv"][1]).parent.name: s for s in seen if s["argv"][0].endswith("bench.py")}
    assert set(workers) == {"setting-1", "setting-2", "setting-3"}
    swapped = workers["setting-1"]  # fp8:4, first
    # compute, the swap engine's copy stream, the offloaded boundaries' side stream
    assert swapped["streams"] == ["compute", "copy", "copy"] and swapped["host"] == ["registered"]  # at exit
    assert workers["setting-2"]["streams"] == ["compute", "copy"]  # fp8:0: offload only
    assert swapped["landed_early"] > 0 and swapped["copies_in_flight_at_exit"] == 0
    bench = json.loads((out / "bench-flux" / "bench.json").read_text())
    assert [(x["setting"], x["status"]) for x in bench["results"]] == [("fp8:4", "ok"), ("fp8:0", "ok"), ("fp8c:4", "ok")]
    assert all(x["offload_checkpoints"]["host_memory"].keys() == {"registered"} for x in bench["results"])
    assert workers["setting-3"]["streams"] == ["compute", "copy", "copy"]  # fp8c:4 swaps as fp8:4 does
    assert [a["agree"] for a in bench["loss_agreement"]] == [True, True], bench["loss_agreement"]


@pytest.mark.slow
def test_a_missing_library_skips_the_steps_that_need_it(tmp_path) -> None:
    out = tmp_path / "check"
    env = {**_script_env(), "GPU_CHECK_EXTRA_MODULES": "imglora_test_no_such_module", "GPU_CHECK_PIP": "0"}
    r = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), "--dry-run", "--out", str(out)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:]
    assert "MISSING (could not install): imglora_test_no_such_module" in r.stdout
    status = {s.split("\t")[0]: s.split("\t")[1] for s in (out / "steps.tsv").read_text().splitlines()}
    assert status == {"env": "ok", "probe": "ok", "pytest": "skipped", "bench": "skipped", "diagnose": "skipped",
                      "plan": "skipped"}
    assert "not run: needs pytest" in (out / "summary.md").read_text()


def test_shellcheck_finds_nothing_if_installed() -> None:
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed")
    r = subprocess.run([exe, str(BENCH / "gpu_check.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


@pytest.mark.slow
def test_a_bench_that_trained_nan_is_diagnosed_with_launch_blocking_and_anomaly_detection(tmp_path) -> None:
    """As after the first H200 run's bench (NaN from the second update): the diagnose step runs the
    bare control (no imglora), then imglora's plain bf16:0 with offloaded checkpoints off, first with
    the math attention kernel, then one update with CUDA_LAUNCH_BLOCKING=1 and --detect-anomaly (here
    on the CPU, where the tiny model trains finite losses, so all pass)."""
    out = tmp_path / "check"
    (out / "bench-flux").mkdir(parents=True)
    nan = {"setting": "fp8:4", "status": "ok", "losses": [3.38, float("nan")]}
    (out / "bench-flux" / "bench.json").write_text(json.dumps({"results": [nan]}))
    env = dict(_script_env(), GPU_CHECK_STEPS="diagnose", GPU_CHECK_BISECT_CASES="env,flux:flash:1024")
    r = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), "--dry-run", "--out", str(out)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)
    log = (out / "check.log").read_text()
    status = {s.split("\t")[0]: s.split("\t")[1:] for s in (out / "steps.tsv").read_text().splitlines()}
    # first the bare control, no imglora: its summary and the kernel it found finite
    assert status["diagnose-bisect"][0] == "ok", log[-4000:]
    assert json.loads((out / "bisect" / "summary.json").read_text())["flux_1024"] == {"flash": "ok"}
    assert status["diagnose"][0] == "ok", log[-4000:]
    assert "CUDA_LAUNCH_BLOCKING=1, autograd anomaly detection, one update of bf16:0" in status["diagnose"][3]
    assert "--detect-anomaly --set memory.offload_checkpoints=false" in log and "--blocks bf16:0 --steps 1" in log
    assert log.count("--set memory.offload_checkpoints=false") == 2
    diag = json.loads((out / "diagnose" / "bench.json").read_text())
    assert [x["setting"] for x in diag["results"]] == ["bf16:0"] and diag["results"][0]["status"] == "ok"
    # then asynchronous as the bench, with PyTorch's math attention kernel: finite = a fused kernel's fault
    assert status["diagnose-math"][0] == "ok" and "attention_kernel = math" in status["diagnose-math"][3]
    assert '--set memory.attention_kernel="math"' in log
    math = json.loads((out / "diagnose-math" / "bench.json").read_text())["results"][0]
    assert math["status"] == "ok" and len(math["losses"]) == 3 and all(x == x for x in math["losses"])
    assert log.index("== [diagnose-bisect]") < log.index("== [diagnose-math]") < log.index("== [diagnose]")
    # the summary says what each diagnosis found
    summary = (out / "summary.md").read_text()
    assert "Diagnosis (the bench crashed or trained a NaN):" in summary
    assert "- bare control, FLUX.1-dev 1024 px per kernel (PyTorch's default here: unknown): flash: ok; " \
           "kernel to use: flash" in summary
    shown = ", ".join(f"{x:.6f}" for x in math["losses"])
    assert f"- math attention kernel, asynchronous, bf16:0: losses [{shown}] all finite" in summary
    assert "- CUDA_LAUNCH_BLOCKING=1 with autograd anomaly detection, bf16:0: losses [" in summary
    assert r.returncode in (0, 1)  # the summary of a dry run without bench, pytest or probe steps


@pytest.mark.slow
def test_the_gpu_window_s_two_commands_dry_run(tmp_path) -> None:
    """The next GPU window: the bare bisect alone, then the bench with the kernel its summary names
    (read from its file) and the SDXL and LLM families, as README's "GPU status" gives them."""
    one, two = tmp_path / "gpu-1", tmp_path / "gpu-2"
    env = dict(_script_env(), GPU_CHECK_STEPS="bisect", GPU_CHECK_BISECT_CASES="env,flux:flash:1024")
    subprocess.run(["bash", str(BENCH / "gpu_check.sh"), "--dry-run", "--out", str(one)], cwd=tmp_path,
                   env=env, capture_output=True, text=True, timeout=600)
    steps = {s.split("\t")[0]: s.split("\t")[1] for s in (one / "steps.tsv").read_text().splitlines()}
    assert steps["bisect"] == "ok" and steps["bench"] == "skipped", (one / "check.log").read_text()[-3000:]
    assert (one / "bisect" / "kernel").read_text() == "flash\n"
    assert "- bare control (no imglora): " in (one / "summary.md").read_text()
    env = dict(_script_env(), GPU_CHECK_STEPS="bench families", GPU_CHECK_BLOCKS="fp8:4,bf16:0",
               GPU_CHECK_REFERENCE="bf16:0", GPU_CHECK_KERNEL=str(one / "bisect" / "kernel"))
    subprocess.run(["bash", str(BENCH / "gpu_check.sh"), "--dry-run", "--out", str(two)], cwd=tmp_path,
                   env=env, capture_output=True, text=True, timeout=900)  # (steps.tsv below says what ran)
    log = (two / "check.log").read_text()
    steps = {s.split("\t")[0]: s.split("\t")[1] for s in (two / "steps.tsv").read_text().splitlines()}
    assert steps["bench"] == steps["families-sdxl"] == steps["families-llm"] == "ok", log[-4000:]
    assert "attention kernel for bench and families: flash (GPU_CHECK_KERNEL)" in log
    bench = json.loads((two / "bench-flux" / "bench.json").read_text())
    assert 'memory.attention_kernel="flash"' in bench["overrides"]
    assert [x["setting"] for x in bench["results"]] == ["fp8:4", "bf16:0"]
    agree = [a for a in bench["loss_agreement"] if a["reference"] == "bf16:0"]
    assert agree and agree[0]["setting"] == "fp8:4"
    summary = (two / "summary.md").read_text()
    assert "- SDXL (full UNet), bf16:0: losses [" in summary and "- chat LLM (full architecture, 4-bit base), model:0: losses [" in summary
    assert summary.count("all finite") >= 2
    bad = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path / "x")], cwd=tmp_path,
                         env=dict(env, GPU_CHECK_KERNEL="fast"), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "GPU_CHECK_KERNEL=fast: expected auto, flash, efficient, cudnn or math" in bad.stderr



@pytest.mark.slow  # (four tiny families' benches: CI runs it)
def test_the_new_families_step_dry_run(tmp_path) -> None:
    """GPU_CHECK_STEPS=new-families: Z-Image, FLUX.2 [klein], Krea 2 and Qwen-Image 2.1 through bench-swap with their
    presets' setting, each reported in the summary with its losses."""
    out = tmp_path / "gpu-3"
    env = dict(_script_env(), GPU_CHECK_STEPS="new-families")
    subprocess.run(["bash", str(BENCH / "gpu_check.sh"), "--dry-run", "--out", str(out)], cwd=tmp_path,
                   env=env, capture_output=True, text=True, timeout=900)
    log = (out / "check.log").read_text()
    steps = {s.split("\t")[0]: s.split("\t")[1] for s in (out / "steps.tsv").read_text().splitlines()}
    names = ("z-image", "flux2-klein", "krea2", "qwen-image-2.1")
    assert all(steps[f"families-{n}"] == "ok" for n in names), log[-4000:]
    summary = (out / "summary.md").read_text()
    for label in ("Z-Image Turbo (full architecture)", "FLUX.2 [klein] base 4B (full architecture)",
                  "Krea 2 Raw (full architecture)", "Qwen-Image 2.1 (full architecture)"):
        assert f"- {label}, fp8:0: losses [" in summary and "all finite" in summary.split(f"- {label}, fp8:0")[1].split("\n")[0]

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from imglora.commands import bench
from imglora.cli import main
from imglora.errors import ImgloraError

REPO = Path(__file__).resolve().parents[2]
TINY_FLUX = str(REPO / "presets" / "tiny-flux.toml")


def test_parse_settings_and_sizes() -> None:
    assert [s.name for s in bench.parse_settings("0, 9,18", default_fp8=True)] == ["fp8:0", "fp8:9", "fp8:18"]
    assert [s.name for s in bench.parse_settings("fp8:18,bf16:0,4", default_fp8=False)] == ["fp8:18", "bf16:0", "model:4"]
    with pytest.raises(ImgloraError, match="expected N or PRECISION:N"):
        bench.parse_settings("fp4:2", default_fp8=True)
    assert bench.parse_size("24GB") == 24 * 2**30 and bench.parse_size("80GiB") == 80 * 2**30
    assert bench.parse_size("512MB") == 512 * 2**20 and bench.parse_size(None) is None
    with pytest.raises(ImgloraError, match="expected a size"):
        bench.parse_size("lots")


def _ok(setting: str, spu: float, reserved: int) -> dict:
    return {"setting": setting, "status": "ok", "device": "cuda", "sec_per_update": {"median": spu},
            "peak_reserved": reserved}


def test_best_setting_respects_the_budget() -> None:
    gib = 2**30
    results = [_ok("fp8:0", 1.0, 30 * gib), _ok("fp8:9", 1.05, 20 * gib), _ok("fp8:18", 1.2, 12 * gib),
               {"setting": "bf16:0", "status": "oom", "stage": "backward"}]
    assert bench.best_setting(results, None)["setting"] == "fp8:0"
    best = bench.best_setting(results, 24 * gib)
    assert best["setting"] == "fp8:9" and "within the 24 GiB budget" in best["text"]
    assert bench.best_setting(results, 8 * gib)["setting"] is None


def test_oom_is_reported_with_its_stage(monkeypatch) -> None:
    from imglora.families import flux

    def oom(self, batch, gen):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(flux.model.FluxTrainable, "loss", oom)
    r = bench.run_setting({"preset": TINY_FLUX, "overrides": [], "precision": "fp8", "blocks": 2, "steps": 1,
                           "warmup": 0, "resolution": 64, "arch": "preset"})
    assert (r["status"], r["stage"]) == ("oom", "forward") and "Tried to allocate" in r["error"]


@pytest.mark.slow
def test_cli_sweep_writes_table_json_csv_png_and_goes_on_after_a_failure(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "bench"
    real_worker = bench._run_worker

    def worker(spec, folder, timeout):  # fp8:2 gets one second: its process is stopped before a result
        return real_worker(spec, folder, 1 if spec["blocks"] == 2 else timeout)

    monkeypatch.setattr(bench, "_run_worker", worker)
    r = CliRunner().invoke(main, ["bench-swap", TINY_FLUX, "--blocks", "0,fp8:2,fp32:4", "--steps", "2", "--warmup",
                                  "1", "--resolution", "64", "--out", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "bench.json").read_text())
    by = {x["setting"]: x for x in report["results"]}
    assert by["fp8:0"]["status"] == "ok" and by["fp32:4"]["status"] == "ok"  # the sweep went on after fp8:2
    assert by["fp8:2"]["status"] == "timeout" and "no result after 1 s" in by["fp8:2"]["error"]
    assert by["fp32:4"]["swap"]["swapped_blocks"] == 6  # kohya: 4 = 2 double + 4 single
    assert by["fp32:4"]["h2d_bytes_per_update"] > 0 and by["fp8:0"]["h2d_bytes_per_update"] == 0
    assert by["fp8:0"]["weight_bytes"] < by["fp32:4"]["weight_bytes"]  # fp8 base weights are smaller
    assert by["fp8:0"]["sec_per_update"]["n"] == 2 and by["fp8:0"]["data"] == "synthetic"
    assert "timeout (unknown)" in r.output and "best: " in r.output
    assert (out / "bench.csv").read_text().splitlines()[0].startswith("setting,status,s/update median")
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


def _trained(setting: str, losses: list[float], device: str = "cpu") -> dict:
    return {"setting": setting, "status": "ok", "losses": losses, "device": device}


def test_losses_of_one_precision_must_agree() -> None:
    same = bench.loss_agreement([_trained("fp8:0", [1.0, 0.5]), _trained("fp8:18", [1.0, 0.5 * (1 + 5e-5)]),
                                 _trained("fp32:0", [2.0, 1.0])])
    assert [(a["reference"], a["setting"], a["agree"]) for a in same] == [("fp8:0", "fp8:18", True)]
    assert "largest relative difference 5.00e-05 over 2 updates" in same[0]["text"]
    wrong = bench.loss_agreement([_trained("fp8:0", [1.0, 0.5]), _trained("fp8:18", [1.0, 0.6])])
    assert not wrong[0]["agree"] and "DIFFER" in wrong[0]["text"]
    nan = bench.loss_agreement([_trained("fp8:0", [1.0]), _trained("fp8:9", [float("nan")])])
    assert not nan[0]["agree"]
    # bf16 autocast on a GPU: within bf16's resolution, not float32's
    gpu = bench.loss_agreement([_trained("fp8:0", [1.0], "cuda"), _trained("fp8:18", [1.004], "cuda")])
    assert gpu[0]["agree"] and gpu[0]["rtol"] == pytest.approx(2**-7)


def test_fp8_storage_is_held_to_the_bf16_weights_within_its_own_stated_tolerance() -> None:
    """fp8:18,bf16:0,fp8c:18 (the GPU window's bench): fp8 storage against bf16:0 within 5 % (e4m3
    rounds every frozen weight: a different model, not bf16's resolution); fp8c has no fp8 storage
    setting of its count here, so it is set against nothing."""
    from imglora.plan.agreement import FP8_STORAGE_RTOL

    results = [_trained("fp8:18", [1.0, 0.52], "cuda"), _trained("bf16:0", [1.01, 0.5], "cuda"),
               _trained("fp8c:18", [0.98, 0.5], "cuda")]
    fp8c_vs_fp8 = [a for a in bench.loss_agreement(results) if a["setting"] == "fp8c:18"]
    (a,) = [a for a in bench.loss_agreement(results) if a["reference"] == "bf16:0"]
    assert a["setting"] == "fp8:18" and a["agree"] and a["rtol"] == FP8_STORAGE_RTOL == 0.05
    assert a["max_rel_diff"] == pytest.approx(0.04) and "fp8 storage's tolerance 5e-02" in a["text"]
    assert fp8c_vs_fp8 and fp8c_vs_fp8[0]["reference"] == "fp8:18"
    (far,) = [a for a in bench.loss_agreement([_trained("fp8:18", [1.0], "cuda"), _trained("bf16:0", [1.2], "cuda")])
              if a["reference"] == "bf16:0"]
    assert not far["agree"] and far["text"].endswith("DIFFER: fp8 storage strays from the bf16 weights")


def test_compiled_settings_parse_and_are_held_to_their_eager_setting_s_losses() -> None:
    settings = bench.parse_settings("fp8c+compile:18, fp8+compile:0,+compile:4,18", default_fp8=True)
    assert [(s.name, s.precision, s.compiled) for s in settings] == [
        ("fp8c+compile:18", "fp8c", True), ("fp8+compile:0", "fp8", True), ("fp8+compile:4", "fp8", True),
        ("fp8:18", "fp8", False)]
    with pytest.raises(ImgloraError, match=r"'fp8\+compiled:1'.* each optionally followed by \+compile"):
        bench.parse_settings("fp8+compiled:1", default_fp8=True)
    results = [_trained("fp8:18", [1.0, 0.5]), _trained("fp8+compile:18", [1.0, 0.5 * (1 + 2e-5)]),
               _trained("fp8+compile:0", [1.0, 0.5 * (1 + 3e-5)]), _trained("fp8c+compile:0", [1.0, 0.7])]
    pairs = {(a["reference"], a["setting"]): a["agree"] for a in bench.loss_agreement(results)}
    # compiled against compiled (one precision), and each compiled setting against its eager one where run
    assert pairs == {("fp8+compile:18", "fp8+compile:0"): True, ("fp8:18", "fp8+compile:18"): True}
    bad = bench.loss_agreement([_trained("fp8:0", [1.0]), _trained("fp8+compile:0", [1.1])])
    assert bad[0]["text"].endswith("DIFFER: compiled blocks compute differently")


@pytest.mark.slow
def test_a_compiled_setting_reports_its_compile_time_and_trains_the_eager_losses() -> None:
    spec = {"preset": TINY_FLUX, "overrides": ["cache.text_max_length=16"], "precision": "fp8", "steps": 2,
            "warmup": 1, "resolution": 64, "arch": "preset", "blocks": 4}
    eager = bench.run_setting(spec)
    comp = bench.run_setting({**spec, "compile": True})
    assert eager["status"] == comp["status"] == "ok"
    assert eager["compile"] is None and eager["compile_seconds"] is None
    assert comp["compile"]["blocks"] == 12 and comp["compile"]["fp8_layers_in_graph"] > 0
    # the first update compiled both kinds of block: far above the median of the others
    assert comp["compile_seconds"] == pytest.approx(comp["first_update_seconds"] - comp["sec_per_update"]["median"])
    assert comp["compile_seconds"] > 10 * comp["sec_per_update"]["median"]
    (agreement,) = bench.loss_agreement([{**eager, "setting": "fp8:4"}, {**comp, "setting": "fp8+compile:4"}])
    assert agreement["agree"] and agreement["reference"] == "fp8:4", agreement
    assert "first update" in bench._one_line({**comp, "status": "ok"})


def test_a_swapped_setting_trains_the_losses_of_the_unswapped_one() -> None:
    """The worker records each update's loss; swapping 4 blocks does not change them."""
    spec = {"preset": TINY_FLUX, "overrides": ["cache.text_max_length=16"], "precision": "fp8", "steps": 2,
            "warmup": 1, "resolution": 64, "arch": "preset"}
    a = bench.run_setting({**spec, "blocks": 0})
    b = bench.run_setting({**spec, "blocks": 4})
    assert a["status"] == b["status"] == "ok"
    assert len(a["losses"]) == 3 and all(math.isfinite(x) and x > 0 for x in a["losses"])
    agreement = bench.loss_agreement([{**a, "setting": "fp8:0"}, {**b, "setting": "fp8:4"}])
    assert agreement[0]["agree"], agreement
    # the figures the GPU check records beside seconds per update
    for r in (a, b):
        prof = r["profiled_update"]
        assert set(prof) == {"forward", "backward", "optimizer", "total"} and all(v > 0 for v in prof.values())
        assert prof["total"] == pytest.approx(prof["forward"] + prof["backward"] + prof["optimizer"], abs=3e-6)
        assert r["setup_peak_allocated"] is None  # no CUDA statistics on the CPU
    assert a["swap_copies"] is None
    copies = b["swap_copies"]  # 2 double + 4 single blocks swapped, each in forward and in backward
    assert copies["loads_per_update"] > 0 and 0 <= copies["stalls_per_update"] <= copies["loads_per_update"]


def test_counts_the_model_cannot_have_are_refused_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    r = CliRunner().invoke(main, ["bench-swap", TINY_FLUX, "--blocks", "0,999,fp32:9", "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert "--blocks: fp8:999, fp32:9: tiny:flux cannot swap that many blocks" in r.output
    assert "the largest valid number is 8" in r.output and "Traceback" not in r.output
    assert "running in a fresh process" not in r.output and not out.exists()


def test_the_worker_refuses_a_count_too_before_reading_weights() -> None:
    r = bench.run_setting({"preset": TINY_FLUX, "overrides": [], "precision": "fp8", "blocks": 40, "steps": 1,
                           "warmup": 0, "resolution": 64, "arch": "preset"})
    assert (r["status"], r["stage"]) == ("error", "load") and "the largest valid number is" in r["error"]


def test_no_setting_finished_is_a_non_zero_exit(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    r = CliRunner().invoke(main, ["bench-swap", TINY_FLUX, "--blocks", "0", "--timeout", "1", "--out", str(out)])
    assert r.exit_code == 1, r.output
    assert "best: no setting finished" in r.output and "timeout (unknown)" in r.output
    assert json.loads((out / "bench.json").read_text())["best"]["setting"] is None  # the report is still written


@pytest.mark.parametrize("args, option", [(["--steps", "-3"], "--steps"), (["--warmup", "-1"], "--warmup"),
                                          (["--timeout", "0"], "--timeout")])
def test_bad_numbers_exit_2_naming_the_option(args, option) -> None:
    r = CliRunner().invoke(main, ["bench-swap", TINY_FLUX, *args])
    assert r.exit_code == 2 and option in r.output and "Traceback" not in r.output


def shrink_full_architectures(monkeypatch) -> None:
    from imglora.families import flux, sdxl

    monkeypatch.setattr(flux.model, "FULL_TRANSFORMER", {
        "guidance_embeds": True, "num_layers": 2, "num_single_layers": 4, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32, "axes_dims_rope": (4, 6, 6)})
    monkeypatch.setattr(sdxl.model, "FULL_UNET", {
        **sdxl.model.FULL_UNET, "block_out_channels": (32, 64, 64), "attention_head_dim": (2, 4, 4),
        "transformer_layers_per_block": (1, 1, 1), "cross_attention_dim": 64, "addition_time_embed_dim": 8,
        "projection_class_embeddings_input_dim": 6 * 8 + 32, "norm_num_groups": 8})


@pytest.mark.parametrize("family", ["flux", "sdxl"])
def test_full_architecture_path_runs(family: str, monkeypatch) -> None:
    """`--arch full` builds the real architecture on the meta device, then fills it; here with the
    same code on a shrunk config (the real ones need a GPU box's memory)."""
    shrink_full_architectures(monkeypatch)
    preset = TINY_FLUX if family == "flux" else str(REPO / "presets" / "tiny-sdxl.toml")
    blocks = 4 if family == "flux" else 0
    r = bench.run_setting({"preset": preset, "overrides": ["cache.text_max_length=16"], "precision": "fp8",
                           "blocks": blocks, "steps": 1, "warmup": 1, "resolution": 64, "arch": "full"})
    assert r["status"] == "ok", r
    assert r["sec_per_update"]["n"] == 1 and r["weight_bytes"] > 0
    if family == "flux":
        assert r["swap"]["swapped_blocks"] == 2 + 4 and r["h2d_bytes_per_update"] > 0


@pytest.mark.parametrize("fuzz", [8, pytest.param(None, marks=pytest.mark.slow)])
def test_full_architecture_setting_on_the_cuda_standin(monkeypatch, fuzz) -> None:
    """The `--arch full` worker's CUDA path (tests/cuda_standin.py): FLUX built block by block with
    swapped blocks sent to page-locked host memory, fp8, swap and offloaded boundaries on their
    streams, the set-up peak read and reset, the profiled update timed with CUDA events; with
    fuzzed copy latencies, no ordering violation. The config is shrunk as above."""
    from accelerate.state import AcceleratorState
    from cuda_standin import AsyncCuda

    from imglora.memory import offload

    shrink_full_architectures(monkeypatch)
    fake = AsyncCuda(fuzz=fuzz)
    fake.install(monkeypatch)
    monkeypatch.setattr(offload, "MIN_BYTES", 1024)
    AcceleratorState._reset_state(True)  # CUDA's bf16 mixed precision, not another test's state
    try:
        with fake.active():
            r = bench.run_setting({"preset": TINY_FLUX, "overrides": ["cache.text_max_length=16"], "precision": "fp8",
                                   "blocks": 4, "steps": 2, "warmup": 1, "resolution": 64, "arch": "full"})
    finally:
        AcceleratorState._reset_state(True)
    assert r["status"] == "ok", r
    assert fake.violations == [], fake.violations
    assert r["swap"]["swapped_blocks"] == 6 and r["swap"]["host_memory"].keys() == {"registered"}
    assert r["offload_checkpoints"]["moves"] and r["offload_checkpoints"]["host_memory"].keys() == {"registered"}
    assert r["setup_peak_allocated"] is not None and r["swap_copies"]["loads_per_update"] > 0
    assert r["profiled_update"]["total"] > 0  # CUDA events' elapsed times (the stand-in's clock)
    assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
    assert (fake.landed_early > 0) == (fuzz is not None)


@pytest.mark.slow
def test_full_width_flux_setting_on_the_cuda_standin(monkeypatch) -> None:
    """`bench-swap presets/flux.toml --arch full` as the GPU check runs it, on the CUDA stand-in, at
    FLUX.1-dev's real width (3072, 24 heads, T5's 4096-wide text, bf16 as the preset says on CUDA)
    with the depth cut to 1 double + 4 single blocks so it fits this machine (12B parameters do not):
    3 swapped, by kohya's count, are the double block and all 4 single ones; the boundaries at 256 px are large enough to move at the product's own 1 MiB
    floor. About a minute and 3 GB."""
    from accelerate.state import AcceleratorState
    from cuda_standin import AsyncCuda

    from imglora.families import flux

    monkeypatch.setattr(flux.model, "FULL_TRANSFORMER", {**flux.model.FULL_TRANSFORMER, "num_layers": 1,
                                                         "num_single_layers": 4})
    fake = AsyncCuda(fuzz=5)
    fake.install(monkeypatch)
    AcceleratorState._reset_state(True)
    try:
        with fake.active():
            r = bench.run_setting({"preset": str(REPO / "presets" / "flux.toml"), "overrides": ["cache.text_max_length=16"],
                                   "precision": "fp8", "blocks": 3, "steps": 1, "warmup": 1, "resolution": 256,
                                   "arch": "full"})
    finally:
        AcceleratorState._reset_state(True)
    assert r["status"] == "ok", r
    assert fake.violations == [] and fake.landed_early > 0, fake.violations
    assert r["swap"]["blocks_per_list"] == {"transformer_blocks": 1, "single_transformer_blocks": 4}
    assert r["swap"]["host_memory"].keys() == {"registered"}
    # 4 single blocks through 2 slots, evicted lazily: 2 copies in forward, 2 in backward
    assert r["swap_copies"] == {"loads_per_update": 4.0, "stalls_per_update": 0.0}
    assert r["h2d_bytes_per_update"] > 4 * 130 * 2**20  # a FLUX.1-dev single block in fp8: 141 M parameters
    assert r["offload_checkpoints"]["host_memory"].keys() == {"registered"}
    assert all(math.isfinite(x) for x in r["losses"])


def test_fp8_compute_is_a_setting_set_against_fp8_storage() -> None:
    """``fp8c:N`` trains with memory.fp8_compute; its losses are compared with fp8's at the same
    swap count, within fp8 compute's own tolerance (a broken kernel path would be far off)."""
    assert [s.name for s in bench.parse_settings("fp8:4,fp8c:4", True)] == ["fp8:4", "fp8c:4"]
    spec = {"preset": TINY_FLUX, "overrides": ["cache.text_max_length=16"], "steps": 2, "warmup": 1,
            "resolution": 64, "arch": "preset", "blocks": 4}
    a = bench.run_setting({**spec, "precision": "fp8"})
    c = bench.run_setting({**spec, "precision": "fp8c"})
    assert a["status"] == c["status"] == "ok" and a["losses"] != c["losses"]  # really another path
    (agreement,) = bench.loss_agreement([{**a, "setting": "fp8:4"}, {**c, "setting": "fp8c:4"}])
    assert agreement["agree"] and agreement["rtol"] == bench.FP8_COMPUTE_RTOL, agreement
    assert "fp8c:4 vs fp8:4: largest relative difference" in agreement["text"]
    wrong = {**c, "setting": "fp8c:4", "losses": [x * 1.5 for x in c["losses"]]}
    (bad,) = bench.loss_agreement([{**a, "setting": "fp8:4"}, wrong])
    assert not bad["agree"] and "DIFFER: fp8 compute strays from fp8 storage" in bad["text"]


def test_the_fused_fp8_path_is_a_setting_held_to_fp8_storage_s_losses() -> None:
    """``fp8f:N`` trains with memory.fp8_fused (the record says so); the same math rounded in other
    places, so its losses are held to the tolerance of one precision's settings."""
    assert [(s.name, s.precision) for s in bench.parse_settings("fp8f:4,fp8f+compile:0", True)] == [
        ("fp8f:4", "fp8f"), ("fp8f+compile:0", "fp8f")]
    spec = {"preset": TINY_FLUX, "overrides": ["cache.text_max_length=16"], "steps": 2, "warmup": 1,
            "resolution": 64, "arch": "preset", "blocks": 4}
    a = bench.run_setting({**spec, "precision": "fp8"})
    f = bench.run_setting({**spec, "precision": "fp8f"})
    assert a["status"] == f["status"] == "ok" and f["fp8"]["fused"] is True and a["fp8"]["fused"] is False
    (agreement,) = bench.loss_agreement([{**a, "setting": "fp8:4"}, {**f, "setting": "fp8f:4"}])
    assert agreement["agree"] and agreement["rtol"] == bench.LOSS_RTOL["fp32"], agreement
    wrong = {**f, "setting": "fp8f:4", "losses": [x * 1.01 for x in f["losses"]]}
    (bad,) = bench.loss_agreement([{**a, "setting": "fp8:4"}, wrong])
    assert not bad["agree"] and "DIFFER: the fused dequantizing path computes differently" in bad["text"]


# As the first H200 run left them: the C++ frames an abort prints after the Python traceback, and
# nothing in the log said which update or stage the worker was in.
H200_LOG = """bench-worker: load
bench-worker: memory setup
bench-worker: update 1: forward
bench-worker: update 1: backward
Traceback (most recent call last):
  File "/work/main/src/imglora/loop.py", line 212, in step
    s.accelerator.backward(loss)
RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, opa, opb, m, n, k)`
terminate called after throwing an instance of 'c10::AcceleratorError'
  what():  CUDA error: an illegal memory access was encountered
Exception raised from insert_events at /pytorch/c10/cuda/CUDACachingAllocator.cpp:3726 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f into libc10.so)
frame #20: Py_RunMain + 0x281 (0x6bcba1 in /opt/torch/.venv/bin/python3)
"""


def test_a_worker_that_dies_is_reported_with_its_stage_and_its_error_not_the_frames() -> None:
    assert bench.last_trace(H200_LOG) == "update 1: backward"
    assert bench.last_trace("Traceback ...\nKilled\n") == "unknown"
    lines = H200_LOG.splitlines()
    error = bench.error_lines(lines)
    assert error.splitlines()[0].startswith("RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED")
    assert "terminate called after throwing" in error and "frame #" not in error
    assert bench.error_lines(["a", "b", "c", "d", "e", "f"]) == "b\nc\nd\ne\nf"  # no exception line: the tail


def test_the_worker_traces_its_stages_on_stderr(capfd) -> None:
    r = bench.run_setting({"preset": TINY_FLUX, "overrides": ["cache.text_max_length=16"], "precision": "fp8",
                           "blocks": 0, "steps": 1, "warmup": 0, "resolution": 64, "arch": "preset"})
    assert r["status"] == "ok" and r["first_nonfinite_update"] is None
    assert len(r["grad_norms"]) == 1 and math.isfinite(r["grad_norms"][0]) and r["grad_norms"][0] > 0
    err = capfd.readouterr().err
    marks = [line for line in err.splitlines() if line.startswith(bench.TRACE)]
    assert marks[:4] == ["bench-worker: load", "bench-worker: memory setup", "bench-worker: update 1: forward",
                         "bench-worker: update 1: backward"]
    assert "bench-worker: profiled update: optimizer" in marks


def _nan_from_update(n: int, monkeypatch) -> None:
    """The loss's backward gives NaN gradients from update ``n`` on (a broken kernel, as it were)."""
    from imglora.training import step as loop

    real = loop.forward_loss
    calls = [0]

    def forward_loss(*a, **k):
        calls[0] += 1
        loss = real(*a, **k)
        if calls[0] >= n:  # sqrt's gradient at 0 is infinite; times 0 it is NaN
            loss = loss + 0 * torch.sqrt(loss - loss)
        return loss

    monkeypatch.setattr(loop, "forward_loss", forward_loss)


SPEC = {"preset": TINY_FLUX, "overrides": ["cache.text_max_length=16"], "precision": "fp8", "blocks": 0,
        "steps": 2, "warmup": 1, "resolution": 64, "arch": "preset", "setting": "fp8:0"}


def test_losses_that_stop_being_finite_fail_the_bench(monkeypatch, tmp_path: Path) -> None:
    _nan_from_update(1, monkeypatch)
    r = bench.run_setting(SPEC)
    # every update's loss is finite and its gradients NaN: each is skipped, the weights never NaN
    assert r["status"] == "ok" and all(math.isfinite(x) for x in r["losses"]) and r["skipped_updates"] == [0, 1, 2]
    assert r["first_nonfinite_update"] == 0 and math.isnan(r["grad_norms"][0])
    assert r["first_nonfinite_gradient"].endswith(".lora_A.default.weight")  # the first LoRA weight in the model
    line = bench._one_line(r)
    assert "LOSS NOT FINITE from update 1" in line
    assert f"3 updates skipped for a non-finite gradient (the first in {r['first_nonfinite_gradient']})" in line
    assert bench._row({**r, "setting": "fp8:0"})[1] == "NaN from 1"
    monkeypatch.setattr(bench, "_run_worker", lambda spec, folder, timeout: {**r, "setting": spec["setting"]})
    with pytest.raises(ImgloraError, match=r"losses or gradients not finite in fp8:0 \(from update 1\): those settings trained "
                                           r"nothing"):
        bench.bench_swap(TINY_FLUX, (), bench.parse_settings("0", True), steps=2, warmup=1, resolution=64,
                         vram_budget=None, arch="preset", out_dir=tmp_path / "b", out=lambda s: None)
    assert json.loads((tmp_path / "b" / "bench.json").read_text())["results"][0]["first_nonfinite_update"] == 0


def test_detect_anomaly_names_the_operation_that_made_the_nan(monkeypatch) -> None:
    _nan_from_update(2, monkeypatch)
    with pytest.raises(RuntimeError, match="Function 'SqrtBackward0' returned nan values"):
        bench.run_setting({**SPEC, "detect_anomaly": True})
    torch.autograd.set_detect_anomaly(False)

"""plan_time: a step's kernels priced on a device, swapped blocks simulated pass by pass, and the
seconds `imglora plan` shows beside memory."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from imglora.plan import timing as plan_time
from imglora.cli import main
from imglora.errors import ImgloraError
from imglora.plan.op_count import BACKWARD, BASE, FORWARD, MATMUL, OTHER, Op, OpTally

REPO = Path(__file__).resolve().parents[2]
# A made-up device with round figures, so every expected time below is worked out by hand.
DEV = plan_time.Device("test", "test", {"bf16": 100.0, "fp32": 10.0, "fp8": 200.0}, memory_gbs=1000, link_gbs=10,
                       vram_gib=24, capability=(9, 0), matmul_eff=0.5, attention_eff=(0.5, 0.25), memory_eff=0.5,
                       link_eff=0.5, launch_s=1e-6, host_op_s=(0.0, 0.0), quanto_call_s=(0.0, 0.0))


def test_a_kernel_takes_its_arithmetic_or_its_traffic_whichever_is_longer_and_at_least_a_launch() -> None:
    bf16 = torch.bfloat16
    big = Op(MATMUL, FORWARD, -1, bf16, flops=10**12, bytes=10**6)
    assert plan_time.op_seconds(big, DEV) == pytest.approx(1e12 / (100e12 * 0.5))  # 0.02 s of arithmetic
    thin = Op(MATMUL, FORWARD, -1, bf16, flops=10**6, bytes=10**9)
    assert plan_time.op_seconds(thin, DEV) == pytest.approx(1e9 / (1000e9 * 0.5))  # 2 ms of traffic
    assert plan_time.op_seconds(Op(OTHER, FORWARD, -1, bf16, 0, 8), DEV) == 1e-6  # the launch
    assert plan_time.op_seconds(replace(big, fp8=True), DEV) == pytest.approx(0.01)  # fp8 tensor cores: twice
    assert plan_time.op_seconds(replace(big, dtype=torch.float32), DEV) == pytest.approx(0.2)


def test_a_pass_waits_for_copies_only_where_compute_cannot_hide_them() -> None:
    compute = {0: 1.0, 1: 1.0, 2: 1.0}
    copy = {1: 2.0, 2: 2.0}  # blocks 1 and 2 swapped, 2 s each over the link
    # two slots: both copies start at once, one after the other (0-2, 2-4); block 1 waits 1 s, block 2 1 s
    assert plan_time._pass([0, 1, 2], compute, copy, 0.0, 0.0, slots=2) == (5.0, 2.0)
    # one slot: block 2's copy starts when block 1 has computed (at 3 s) and arrives at 5 s
    assert plan_time._pass([0, 1, 2], compute, copy, 0.0, 0.0, slots=1) == (6.0, 3.0)
    # copies that take less than a block computes are hidden, except the first one
    assert plan_time._pass([0, 1, 2], {0: 0.1, 1: 3.0, 2: 3.0}, {1: 1.0, 2: 1.0}, 0.5, 0.25, 2) == (
        pytest.approx(7.25), pytest.approx(0.4))


def _tally(rows: int) -> OpTally:
    """One block: a frozen 64x32 Linear's product forward and its input gradient, and a GELU."""
    bf16 = torch.bfloat16
    fwd = Op(BASE, FORWARD, 0, bf16, 2 * rows * 32 * 64, 2 * (rows * 32 + 32 * 64 + rows * 64), layer="l",
             weight=2048, other=rows * 32, bias=True, shape=(rows, 32, 64), role="fwd")
    dgrad = replace(fwd, phase=BACKWARD, bias=False, other=rows * 64, role="dgrad",
                    bytes=2 * (rows * 64 + 32 * 64 + rows * 32))
    gelu = Op(OTHER, FORWARD, 0, bf16, 0, 2 * 2 * rows * 64)
    return OpTally([fwd, gelu, dgrad], ["blocks.0"], {"l": 2048})


def test_fp8_storage_adds_the_dequantize_and_fp8_compute_runs_the_products_on_fp8_tensor_cores() -> None:
    tally = _tally(rows=128)
    plain = plan_time.kernels(tally, plan_time.Variant(), cuda=True)
    assert plain == tally.ops
    deq = plan_time.kernels(tally, plan_time.Variant(quantized=frozenset({"l"})), cuda=True)
    products = [o for o in deq if o.flops]
    assert [o.flops for o in products] == [2 * 128 * 32 * 64] * 2 and not any(o.fp8 for o in products)
    # quanto: the weight cast from fp8 (1 byte in, 2 out) and scaled (2 in, 2 out), each use; the bias added apart
    extra = sum(o.bytes for o in deq if not o.flops) - 2 * 2 * 128 * 64
    assert extra >= 2 * 7 * 2048 and any(o.bytes == 2 * (2 * 128 * 64) + 2 * 64 for o in deq)
    fp8c = plan_time.kernels(tally, plan_time.Variant(quantized=frozenset({"l"}), fp8_compute=True), cuda=True)
    fp8_products = [o for o in fp8c if o.fp8]
    assert [o.flops for o in fp8_products] == [2 * 128 * 32 * 64] * 2
    assert plan_time.estimate(tally, plan_time.Variant(quantized=frozenset({"l"})), DEV).seconds > \
        plan_time.estimate(tally, plan_time.Variant(), DEV).seconds
    # 8 rows: not a multiple of 16, so the kernel cannot take it and the fused dequantizing path runs (as in training)
    odd = plan_time.kernels(_tally(rows=8), plan_time.Variant(quantized=frozenset({"l"}), fp8_compute=True), True)
    assert odd == plan_time.kernels(_tally(rows=8), plan_time.Variant(quantized=frozenset({"l"}), fused=True), True)
    assert not any(o.fp8 for o in odd)


@pytest.mark.parametrize("rows", [128, 16])  # the scales on the weight (rows > in), on the output (rows < in)
def test_the_fused_path_casts_each_weight_once_per_use_and_fuses_scales_and_bias(rows) -> None:
    tally = _tally(rows=rows)
    fused = plan_time.kernels(tally, plan_time.Variant(quantized=frozenset({"l"}), fused=True), cuda=True)
    deq = plan_time.kernels(tally, plan_time.Variant(quantized=frozenset({"l"})), cuda=True)
    weight_passes = [o for o in fused if not o.flops and o.from_fp8]
    assert [o.bytes for o in weight_passes] == [3 * 2048] * 2  # one fp8 -> bf16 cast per use (fwd, dgrad)
    assert sum(o.bytes for o in fused) < sum(o.bytes for o in deq)
    assert len([o for o in fused if not o.flops]) < len([o for o in deq if not o.flops])
    v = dict(quantized=frozenset({"l"}))
    assert plan_time.estimate(tally, plan_time.Variant(**v, fused=True), DEV).seconds < \
        plan_time.estimate(tally, plan_time.Variant(**v), DEV).seconds


def test_swapped_blocks_add_only_the_copies_compute_cannot_hide() -> None:
    tally = _tally(rows=128)
    none = plan_time.estimate(tally, plan_time.Variant(), DEV)
    # 5 MB over a 10 GB/s link at 50 %: 1 ms each way, and the block computes for microseconds
    swapped = plan_time.estimate(tally, plan_time.Variant(swapped={"blocks.0": 5 * 10**6}), DEV)
    assert swapped.parts["waiting for copies"] == pytest.approx(2e-3)
    assert swapped.seconds == pytest.approx(none.seconds + 2e-3)
    assert sum(swapped.parts.values()) == pytest.approx(swapped.seconds)


def test_the_gpu_table_names_its_cards_and_only_ada_hopper_blackwell_have_fp8() -> None:
    assert {"h200", "h100", "a100", "3090", "4090", "5090", "l40s"} <= set(plan_time.GPUS)
    for d in plan_time.GPUS.values():
        assert d.peak(torch.bfloat16) > d.peak(torch.float32) > 0 and d.memory_gbs > 0 and d.link_gbs > 0
        assert d.has_fp8 == (d.capability >= (8, 9)), d.name
    assert plan_time.gpu("RTX 4090") is plan_time.GPUS["4090"] and plan_time.gpu("H200").vram_gib > 130
    with pytest.raises(ImgloraError, match="--gpu 'v100': not a GPU imglora knows; use one of h200"):
        plan_time.gpu("v100")


@pytest.mark.slow
def test_plan_shows_seconds_per_update_for_a_card_and_fits_in_its_memory(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(main, ["plan", str(REPO / "presets" / "tiny-flux.toml"), "--gpu", "4090",
                                  "--blocks", "fp8:4,fp8c:4,fp8:0", "--resolution", "256", "--json", str(out)])
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["time_device"] == "4090"
    by = {s["setting"]: s for s in d["settings"]}
    for s in by.values():
        assert s["predicted_seconds_per_update"] > 0
        assert sum(s["predicted_parts"].values()) == pytest.approx(s["predicted_seconds_per_update"])
    assert "| predicted s/update (4090) |" in r.output and "GeForce RTX 4090" in r.output
    assert "a prediction, not a measurement" in r.output
    assert d["fastest_fit"] in by  # 23.6 GiB, the card's own memory, is the budget

    r = CliRunner().invoke(main, ["plan", str(REPO / "presets" / "tiny-flux.toml"), "--gpu", "a100",
                                  "--blocks", "fp8:0,fp8c:0", "--json", str(out)])
    assert r.exit_code == 0, r.output
    by = {s["setting"]: s for s in json.loads(out.read_text())["settings"]}
    assert by["fp8c:0"]["predicted_seconds_per_update"] is None
    assert "fp8c:0: no time predicted: the a100 has no fp8 tensor cores" in r.output


@pytest.mark.slow  # (the default run stays under 6 minutes in a fresh clone; CI runs it)
def test_measured_seconds_from_a_bench_file_take_the_predictions_place(tmp_path: Path) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"results": [
        {"setting": "fp8:4", "status": "ok", "sec_per_update": {"median": 0.5}},
        {"setting": "fp8:4+compile", "status": "ok", "sec_per_update": {"median": 0.25}}]}))
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(main, ["plan", str(REPO / "presets" / "tiny-flux.toml"), "--blocks", "fp8:4,fp8:0",
                                  "--vram", "80GB", "--bench", str(bench), "--json", str(out)])
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    by = {s["setting"]: s for s in d["settings"]}
    assert by["fp8:4"]["measured_seconds_per_update"] == 0.5 and by["fp8:0"]["measured_seconds_per_update"] is None
    assert d["fastest_fit"] == "fp8:4"  # measured first, then predicted
    assert "| measured s/update (bench.json) | 0.500 | - |" in r.output
    assert "measured with compiled blocks (memory.compile = \"blocks\"), s/update: fp8:4+compile 0.250" in r.output


def test_a_gpu_with_a_cpu_plan_is_refused() -> None:
    r = CliRunner().invoke(main, ["plan", str(REPO / "presets" / "tiny-flux.toml"), "--device", "cpu", "--gpu", "4090"])
    assert r.exit_code != 0 and "--gpu is for a CUDA plan" in r.output

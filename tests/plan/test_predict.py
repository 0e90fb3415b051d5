"""imglora plan: the prediction against the bytes a real step allocates, the CLI, the budget check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from imglora.training import step as loop
from imglora.plan import predict as plan, budget as plan_budget
from imglora.cli import main
from imglora.commands.common import family_of, load_config
from imglora.errors import ImgloraError
from imglora.plan.meter import LiveBytes, held_bytes
from imglora.models.resolve import resolve_model
from imglora.memory.wrap import preset_swap, resolve_swap
from loading import tiny_session

REPO = Path(__file__).resolve().parents[2]


def measured_peak(cfg) -> int:
    """Peak tensor bytes over three real training updates on the CPU (training.step.measured_peak)."""
    family = family_of(cfg)
    src = resolve_model(cfg.model, family)
    session, trainable = tiny_session(family, src, cfg, total=10)
    return loop.measured_peak(session, family.synthetic_batch(trainable, cfg.data.resolution, cfg,
                                                              torch.device("cpu")))


@pytest.mark.parametrize("preset,overrides", [
    ("tiny-flux", ["memory.fp8=true", "memory.blocks_to_swap=4"]),
    pytest.param("tiny-flux", ["memory.fp8=false", "memory.blocks_to_swap=0"], marks=pytest.mark.slow),
    pytest.param("tiny-sdxl", ["memory.gradient_checkpointing=false", "data.resolution=64"],
                 marks=pytest.mark.slow),  # (the default run stays under 6 minutes; CI runs it)
    pytest.param("tiny-sdxl", ["lora.text_encoder=true", "data.resolution=64"], marks=pytest.mark.slow),
    pytest.param("tiny-flux", ["lora.text_encoder=true", "memory.blocks_to_swap=0"], marks=pytest.mark.slow),
    pytest.param("tiny-sdxl", ["memory.fp8=true"], marks=pytest.mark.slow),
])
def test_the_prediction_is_within_ten_percent_of_a_real_step(preset: str, overrides: list[str]) -> None:
    cfg = load_config(REPO / "presets" / f"{preset}.toml", overrides)
    family = family_of(cfg)
    setting = plan.Setting("fp8" if cfg.memory.fp8 else "model", cfg.memory.blocks_to_swap)
    predicted = plan.predict(cfg, family, [setting], device_kind="cpu", src=resolve_model(cfg.model, family))
    p = predicted.settings[0]
    real = measured_peak(cfg)
    assert 0.9 * real <= p.device_peak <= 1.1 * real, (p.device_peak, real, [(t.key, t.bytes) for t in p.terms])
    assert p.term("activations_saved") > 0 and p.term("lora") > 0 and p.term("optimizer_state") == 2 * p.term("lora")
    if cfg.lora.text_encoder:  # the encoders trained beside the model: their weights, adapter and state counted
        encoders = family.meta_trainable(resolve_model(cfg.model, family), cfg, torch.float32).text_encoders
        assert p.term("text_encoders") == sum(held_bytes(e) for e in encoders.values()) > 0
        without = plan.predict(cfg.replace(lora={"text_encoder": False}), family, [setting], device_kind="cpu",
                               src=resolve_model(cfg.model, family)).settings[0]
        assert p.term("lora") > without.term("lora") and without.term("text_encoders") == 0
    else:
        assert p.term("text_encoders") == 0


@pytest.mark.slow
def test_cli_plans_flux_from_its_shipped_config_term_by_term(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(main, ["plan", str(REPO / "presets" / "flux.toml"), "--set", "cache.text_max_length=32",
                                  "--blocks", "fp8:18,fp8:0,bf16:0",
                                  "--resolution", "128", "--vram", "16GB", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "planned from the architecture config imglora ships" in r.output
    d = json.loads(out.read_text())
    by = {s["setting"]: s for s in d["settings"]}
    s18, s0, bf = by["fp8:18"], by["fp8:0"], by["bf16:0"]
    # 9 double + 18 single of FLUX.1-dev's 19 + 38 blocks leave the device; two slots per shape come back
    moved = s0["terms"]["weights_resident_blocks"] - s18["terms"]["weights_resident_blocks"]
    assert 5.0 * 2**30 < moved < 5.5 * 2**30 and s18["terms"]["swap_slots"] > 0
    assert s18["terms"]["host_swapped"] >= moved  # the host holds them instead (padded per tensor)
    assert bf["terms"]["weights_resident_blocks"] > 1.9 * s0["terms"]["weights_resident_blocks"]  # bf16 vs fp8
    assert s0["device_peak_bytes"] - s18["device_peak_bytes"] == pytest.approx(
        moved - s18["terms"]["swap_slots"], abs=2**20)
    assert d["fastest_fit"] == "fp8:0"  # bf16 does not fit in 16 GB; fp8 unswapped is the fastest that does
    assert "| **peak allocated** |" in r.output


def test_cli_plans_each_setting_with_the_swap_engines_layout(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(main, ["plan", str(REPO / "presets" / "tiny-flux.toml"), "--blocks", "fp8:6,fp8:0,fp32:0",
                                  "--device", "cpu", "--json", str(out), "--gpus", "2"])
    assert r.exit_code == 0, r.output
    by = {s["setting"]: s for s in json.loads(out.read_text())["settings"]}
    s6, s0, full = by["fp8:6"], by["fp8:0"], by["fp32:0"]
    moved = s0["terms"]["weights_resident_blocks"] - s6["terms"]["weights_resident_blocks"]
    # tiny FLUX: 3 of 4 double + 6 of 8 single blocks swapped; 2 slots per shape hold 2 + 2 of them
    assert moved > 0 and 0 < s6["terms"]["swap_slots"] < moved <= s6["terms"]["swapped_blocks"]
    assert full["terms"]["weights_resident_blocks"] > 2 * s0["terms"]["weights_resident_blocks"]  # fp32 vs fp8
    assert "| **peak allocated** |" in r.output and "| memory (GiB) |" in r.output


@pytest.mark.slow
def test_flux_preset_is_predicted_within_ten_gib_at_1024() -> None:
    cfg = load_config(REPO / "presets" / "flux.toml", [])
    p = plan.predict(cfg, family_of(cfg), [plan.Setting("fp8", 18)], device_kind="cuda", src=None).settings[0]
    assert cfg.memory.offload_checkpoints and p.device_peak <= 10 * 2**30, plan.table(
        plan.Plan("flux", "cuda", 1024, "", [p]))


@pytest.mark.slow
def test_a_vram_budget_refuses_a_setting_that_does_not_fit_and_names_the_change_that_does(tmp_path: Path) -> None:
    base = ["memory.fp8=false", "memory.blocks_to_swap=0", f'cache.dir="{tmp_path / "c"}"']
    cfg = load_config(REPO / "presets" / "tiny-flux.toml", base)
    family = family_of(cfg)
    src = resolve_model(cfg.model, family)
    need = {n: plan.needed_vram(plan.predict(cfg, family, [plan.Setting("model", n)], device_kind="cuda",
                                             src=src).settings[0].device_peak) for n in (0, 6)}
    assert need[6] < need[0]
    budget = (need[0] + need[6]) / 2 / 2**30  # fits with 6 blocks swapped, not with 0
    lines: list[str] = []
    strict = cfg.replace(memory={"vram_budget": budget})
    with pytest.raises(ImgloraError, match=r"memory.vram_budget = .* The smallest change that fits: "
                                           r"memory.blocks_to_swap = [3-6] \(predicted peak"):
        plan_budget.check_at_start(strict, family, src, resolve_swap(family, strict, src), "cpu", lines.append)
    assert lines and lines[0].startswith("memory plan: peak allocated")
    assert plan_budget.check_at_start(cfg, family, src, resolve_swap(family, cfg, src), "cpu",
                                      lines.append) is None  # CPU, no budget: no plan


def test_the_presets_own_per_list_counts_are_its_setting() -> None:
    """[flux] double_blocks_to_swap / single_blocks_to_swap set the blocks per list directly: the plan
    (and train's check at its start, and doctor) plans exactly those, not memory.blocks_to_swap's split."""
    cfg = load_config(REPO / "presets" / "tiny-flux.toml", ["memory.blocks_to_swap=0", "flux.double_blocks_to_swap=2",
                                                            "flux.single_blocks_to_swap=4"])
    family = family_of(cfg)
    src = resolve_model(cfg.model, family)
    own = plan.own_setting(cfg, family, preset_swap(family, cfg, src))
    assert own == plan.Setting("fp8", 0, (2, 4)) and own.name == "fp8:2+4"
    kohya = load_config(REPO / "presets" / "tiny-flux.toml", ["memory.blocks_to_swap=4"])
    assert plan.own_setting(kohya, family, preset_swap(family, kohya, src)) == plan.Setting("fp8", 4)
    assert preset_swap(family, cfg, None).lengths == (19, 38)  # no model: the architecture imglora ships
    p = plan.predict(cfg, family, [own, plan.Setting("fp8", 4), plan.Setting("fp8", 0)], device_kind="cuda",
                     src=src).settings
    # kohya's 4 is 2 double + 4 single blocks: the same layout, so the same plan; 0 swaps nothing
    assert p[0].device_peak == p[1].device_peak and p[0].term("host_swapped") == p[1].term("host_swapped") > 0
    assert p[2].term("host_swapped") == 0
    assert p[2].term("weights_resident_blocks") > p[0].term("weights_resident_blocks")
    # a budget the preset's own 2+4 misses: the count that fits replaces the per-list keys, and says so
    change = plan_budget.smallest_change(cfg, family, src, own, plan.needed_vram(p[0].device_peak) - 1, {})
    assert change is not None and change.startswith("memory.blocks_to_swap = ") and \
        "in place of the preset's own blocks per list (predicted peak" in change, change


def test_the_meter_counts_new_storage_not_views_of_old() -> None:
    w = torch.ones(256, 256)
    with LiveBytes() as m:
        t = w.t()  # a view of a tensor made before: nothing allocated
        y = w @ w  # new: 256 KiB
        m.mark("one")
        del y
        z = torch.empty(100, dtype=torch.float64)
    assert m.marks["one"] == 256 * 256 * 4 and m.peak == 256 * 256 * 4 and m.live == 800
    assert held_bytes(w, [t, w], z) == 256 * 256 * 4 + 800  # shared storage counted once


@pytest.mark.slow
def test_the_prediction_holds_on_a_real_width_architecture(tmp_path: Path) -> None:
    """FLUX.1's real blocks (width 3072), one double and two single, fp8 with and without swap."""
    import subprocess
    import sys

    out = tmp_path / "check.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plan_check.py"), "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert {x["setting"] for x in rows} == {"fp8:0", "fp8:2"}
    assert all(0.9 <= x["ratio"] <= 1.1 for x in rows) and all(x["measured"] > 800 * 2**20 for x in rows)


@pytest.mark.parametrize("command, option, value", [
    ("plan", "--vram", "0GB"), ("plan", "--vram", "-5GB"), ("plan", "--host-ram", "0MB"), ("plan", "--vram", "nanGB"),
    ("plan", "--vram", "infGB"), ("bench-swap", "--vram-budget", "-1GB"), ("bench-swap", "--vram-budget", "0GiB")])
def test_a_size_of_zero_or_less_exits_2_naming_the_option_and_value(command: str, option: str, value: str) -> None:
    """Zero used to mean "no budget" and a negative size "nothing fits"; both are typing slips."""
    r = CliRunner().invoke(main, [command, str(REPO / "presets" / "tiny-sdxl.toml"), option, value])
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '{option}': '{value}': a size must be a finite number greater than 0, such as 24GB " \
           "(leave the option out for no limit)" in r.output
    assert "Traceback" not in r.output
    from imglora.commands.bench import parse_size

    with pytest.raises(ImgloraError, match=f"^{option} '{value}': a size must be"):
        parse_size(value, option)
    assert parse_size("0.5GB", option) == 2**29


def test_the_flux_preset_keeps_its_memory_promise_as_shipped() -> None:
    """presets/flux.toml is planned within 10 GiB at prefetch depth 1; auto (0) would add slots on a
    card with room, so the preset holds the depth, and the tuner only measures and reports."""
    import torch

    from imglora.memory.wrap import prefetch_tuner

    cfg = load_config(REPO / "presets" / "flux.toml", [])
    assert cfg.memory.swap_prefetch == 1 and cfg.memory.blocks_to_swap == 18 and cfg.memory.fp8
    tuner = prefetch_tuner(cfg, torch.device("cuda"), setup=None, out=lambda s: None)
    assert tuner is not None and tuner.grow is False
    auto = load_config(REPO / "presets" / "flux.toml", ["memory.swap_prefetch=0"])
    assert prefetch_tuner(auto, torch.device("cuda"), setup=None, out=lambda s: None).grow is True


@pytest.mark.slow
def test_host_ram_counts_the_boundaries_exactly_and_the_cuda_libraries() -> None:
    """Checkpoint boundaries are counted at their exact size (memory/offload.py registers buffers of
    exactly that size; the caching host allocator would round each up to a power of two), and a CUDA
    process's libraries get their own (estimated) term."""
    from imglora.memory.offload import pinned_bytes

    assert [pinned_bytes(n) for n in (0, 1, 3 << 20, 24 << 20, 32 << 20, (32 << 20) + 1)] == \
        [0, 1, 4 << 20, 32 << 20, 32 << 20, 64 << 20]
    cfg = load_config(REPO / "presets" / "tiny-flux.toml", ["memory.gradient_checkpointing=true",
                                                              "memory.offload_checkpoints=true"])
    profiles: dict = {}
    p = plan.predict(cfg, family_of(cfg), [plan.Setting("fp8", 4)], device_kind="cuda", src=None,
                     resolution=1024, profiles=profiles).settings[0]
    (prof,) = profiles.values()  # the one meta run the prediction made
    assert prof.checkpoint_inputs and all(n > 0 for n in prof.checkpoint_inputs)
    assert sum(pinned_bytes(n) for n in prof.checkpoint_inputs) > sum(prof.checkpoint_inputs)  # not powers of 2
    assert p.term("host_checkpoints") == sum(prof.checkpoint_inputs)
    assert p.term("host_cuda") == plan.CUDA_HOST_ESTIMATE
    assert p.host_peak >= p.term("host_cuda") + p.term("host_swapped") + p.term("host_checkpoints")


def test_a_configs_own_setting_names_its_fp8_path() -> None:
    cfg = load_config(REPO / "presets" / "tiny-flux.toml", [])
    m = cfg.memory
    assert m.fp8 and plan.precision_of(cfg) == "fp8"
    assert plan.precision_of(cfg.replace(memory={"fp8_fused": True})) == "fp8f"
    assert plan.precision_of(cfg.replace(memory={"fp8_compute": True})) == "fp8c"
    assert plan.precision_of(cfg.replace(memory={"fp8": False})) == "model"

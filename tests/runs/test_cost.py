from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from imglora.commands.common import load_config
from imglora.training import checkpoint
from imglora import config
from imglora.runs import cost as ec, record
from imglora.cli import main
from imglora.errors import ImgloraError

REPO = Path(__file__).resolve().parents[2]


def test_session_formula_against_hand_worked_numbers() -> None:
    inputs = ec.SessionInputs(setup=120, cache=300, steps=1000, seconds_per_update=2.5, checkpoints=4,
                              seconds_per_checkpoint=15, evaluation=600, idle=300)
    est = ec.estimate(inputs, rate=2.0, currency="EUR",
                      extras=ec.Extras(storage_gb=100, storage_price_gb_month=0.10, transfer_gb=20, transfer_price_gb=0.09))
    # 120 + 300 + 1000 × 2.5 + 4 × 15 + 600 + 300 = 3880 s
    assert est.terms == {"setup": 120, "cache": 300, "training": 2500, "checkpoints": 60, "evaluation": 600, "idle": 300}
    assert est.seconds == 3880 and est.hours == pytest.approx(1.077778, rel=1e-6)
    assert est.compute_cost == pytest.approx(2.155556, rel=1e-6)           # 1.0778 h × 2.0
    assert est.storage_cost == pytest.approx(100 * 0.10 * 1.077778 / 730, rel=1e-5)  # GB-months used
    assert est.transfer_cost == pytest.approx(1.8)
    assert est.cost == pytest.approx(2.155556 + 0.014764 + 1.8, rel=1e-5)
    text = ec.format_estimate(est, 1000, 2.5)
    assert "training (1000 updates × 2.500 s)" in text and "64.4 %" in text and "EUR" in text


def test_its_conversion_and_refusals() -> None:
    # A log showing 1.6 it/s of micro-batches with accumulation 4: 4 / 1.6 = 2.5 s per update.
    assert ec.seconds_per_update_from(its=1.6, its_unit="micro", grad_accum=4) == pytest.approx(2.5)
    assert ec.seconds_per_update_from(its=1.6, its_unit="update", grad_accum=4) == pytest.approx(0.625)
    assert ec.seconds_per_update_from(its=2.0, grad_accum=1) == pytest.approx(0.5)
    assert ec.seconds_per_update_from(sec_per_micro_batch=0.7, grad_accum=4) == pytest.approx(2.8)
    with pytest.raises(ImgloraError, match="ambiguous with gradient accumulation 4"):
        ec.seconds_per_update_from(its=1.6, grad_accum=4)
    assert ec.steps_for_epochs(10, 25, 1, 4) == 63          # 10 × 25 ÷ (1 × 4) = 62.5, rounded up
    assert ec.checkpoint_count(1000, 250) == 4 and ec.checkpoint_count(1000, 0) == 1


def test_projection_and_what_fits() -> None:
    budget = config.BudgetConfig(max_cost=1.0, hourly_rate=2.0)  # 1.0 / 2.0 per hour = 1800 s allowed
    p = ec.project(budget, step=10, total=1000, elapsed=100.0, seconds_per_update=10.0, checkpoint_every=250,
                   seconds_per_checkpoint=5.0)
    assert p.remaining_checkpoints == 4 and p.seconds == 100 + 990 * 10 + 4 * 5
    assert p.cost == pytest.approx(p.seconds / 3600 * 2.0)
    assert "exceeds train.budget.max_cost = 1 USD" in p.over
    assert p.fits_steps == 10 + (1800 - 100 - 20) // 10
    assert p.stop_advice("USD", 10, 1000) == (
        "stopped by the budget guard at update 10/1000: measured over the first 10 updates, the whole session would "
        f"take 2:47:00 and cost {p.cost:.2f} USD ({p.over}). The budget fits 178 updates in all: set "
        "train.max_steps to 178 or less")
    spent = ec.project(budget, step=10, total=1000, elapsed=1790.0, seconds_per_update=10.0, checkpoint_every=250,
                       seconds_per_checkpoint=5.0)
    assert spent.fits_steps == 9 and spent.stop_advice("USD", 10, 1000).endswith(
        "No further updates fit the budget: raise that limit to train more")
    ok = ec.project(config.BudgetConfig(max_hours=10), step=10, total=1000, elapsed=100.0, seconds_per_update=10.0,
                    checkpoint_every=0, seconds_per_checkpoint=0.0)
    assert ok.over is None and ok.fits_steps is None


def test_cli_estimate_terms_and_offers() -> None:
    r = CliRunner().invoke(main, ["estimate", "--steps", "1000", "--its", "1.6", "--its-unit", "micro", "--accum", "4",
                                  "--setup", "120", "--cache", "300", "--rate", "2", "--offer", "RTX 4090:0.44:3.0",
                                  "--offer", "A100 80GB:1.02"])
    assert r.exit_code == 0, r.output
    assert "training (1000 updates × 2.500 s)" in r.output
    # 120 + 300 + 1000 × 3.0 = 3420 s = 0.95 h, × 0.44 = 0.418; the A100 at this speed: 2920 s = 0.811 h, × 1.02
    assert "offer RTX 4090: 0.95 h, 0.42 USD (0.44 USD/h, 3.000 s/update, measured there)" in r.output
    assert "offer A100 80GB: 0.81 h, 0.83 USD (1.02 USD/h, 2.500 s/update, assumes the speed from --its)" in r.output
    bad = CliRunner().invoke(main, ["estimate", "--steps", "10", "--its", "2", "--accum", "4"])
    assert bad.exit_code == 1 and "ambiguous" in bad.output


@pytest.mark.slow  # the default run has tests/runs/test_offer.py's budget-guard stop (the 6-minute default run)
def test_budget_guard_stops_with_checkpoint_and_records_projection(tmp_path: Path, small_run) -> None:
    args = ["train", str(REPO / "presets" / "tiny-sdxl.toml")]
    for o in small_run(("01_sky", "02_grass")) + ["train.log_every=1", "train.warmup_steps=0","train.max_steps=500", "train.checkpoint_every=0",
                                                 "train.budget.smoke_steps=2", "train.budget.max_hours=0.0001"]:
        args += ["--set", o]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 3, r.output
    assert "stopped by the budget guard at update 5/500" in r.output
    # 0.36 s allowed and more already spent: no further update fits, and the message says so in words.
    assert re.search(r"stopped by the budget guard at update 5/500: measured over the first 5 updates, the whole "
                     r"session would take 0:\d\d:\d\d \(\d+\.\d\d h exceeds train.budget.max_hours = 0.0001\)\. "
                     r"No further updates fit the budget: raise that limit to train more; or pick a faster swap "
                     r"setting", r.output), r.output
    assert "projection after" not in r.output.split("stopped by")[1] and "max_steps to 0" not in r.output
    run = tmp_path / "runs" / "tiny-sdxl"
    assert [s for s, _ in checkpoint.list_checkpoints(run)] == [5]
    assert not (run / "adapter").exists()
    rec = record.read_records(run, "train")[-1]
    assert rec["status"] == "interrupted" and rec["projection"]["at_step"] == 5
    assert rec["projection"]["seconds"] > 0.36 and rec["projection"]["actual_seconds"] > 0


@pytest.mark.slow  # (the default run stays under 6 minutes in a fresh clone; CI runs it)
def test_estimate_reads_a_finished_run(small_run) -> None:
    cfg = load_config(REPO / "presets" / "tiny-sdxl.toml",
                      small_run(("01_sky", "02_grass")) + ["train.log_every=1", "train.warmup_steps=0",
                                                           "train.max_steps=8", "train.checkpoint_every=4"])
    from imglora.commands.train import train

    train(cfg, out=lambda s: None)
    m = ec.from_run(cfg.run_dir)
    assert m.steps == 8 and m.checkpoint_every == 4 and m.seconds_per_update > 0 and m.actual_seconds > 0
    r = CliRunner().invoke(main, ["estimate", str(cfg.run_dir), "--rate", "1.5"])
    assert r.exit_code == 0, r.output
    assert "training (8 updates ×" in r.output and "measured session of that run" in r.output


@pytest.mark.parametrize("args, option, what", [
    (["--rate", "-1"], "--rate", "must be at least 0"),
    (["--rate", "nan"], "--rate", "not a finite number"),
    (["--steps", "-5"], "--steps", "must be at least 1"),
    (["--sec-per-update", "0"], "--sec-per-update", "must be greater than 0"),
    (["--offer", "A100:-2"], "--offer", "finite number >= 0"),
    (["--offer", "A100:1:nan"], "--offer", "finite number > 0"),
    (["--storage", "100:-0.1"], "--storage", "not negative"),
])
def test_estimate_refuses_negative_or_nan_values_naming_the_option(args, option, what) -> None:
    base = {"--steps": "100", "--sec-per-update": "2"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    r = CliRunner().invoke(main, ["estimate", *[x for kv in base.items() for x in kv]])
    assert r.exit_code == 2, r.output
    assert option in r.output and what in r.output
    assert "USD" not in r.output  # no cost printed


def _fake_run(tmp_path: Path, device: str, device_name: str, eval_seconds: float | None) -> Path:
    run = tmp_path / "run"
    rec = record.RunRecord("train", run, {"train": {"checkpoint_every": 0, "batch_size": 1, "grad_accum": 1}})
    rec.data["environment"].update(device=device, device_name=device_name)
    rec.set(setup_seconds=30.0, sec_per_update={"median": 2.0, "mean": 2.0}, total_updates=100, dataset_items=10,
            checkpoint_seconds=[1.0], finish_seconds=1.0)
    rec.data["phases"]["cache"] = 10.0
    rec.write()
    if eval_seconds is not None:
        ev = record.RunRecord("eval", run, {})
        ev.set(seconds=eval_seconds)
        ev.write()
    return run


def test_estimate_counts_the_eval_pass_recorded_after_training(tmp_path: Path) -> None:
    run = _fake_run(tmp_path, "cuda", "NVIDIA H100 80GB HBM3", eval_seconds=123.0)
    assert ec.from_run(run).evaluation == 123.0
    r = CliRunner().invoke(main, ["estimate", str(run)])
    assert r.exit_code == 0, r.output
    assert "evaluation" in r.output and "0:02:03" in r.output


def test_offer_without_its_own_speed_says_which_speed_or_refuses_a_cpu_one(tmp_path: Path) -> None:
    gpu = _fake_run(tmp_path / "g", "cuda", "NVIDIA H100 80GB HBM3", None)
    r = CliRunner().invoke(main, ["estimate", str(gpu), "--offer", "Other H100:2.5"])
    assert r.exit_code == 0, r.output
    assert "assumes the speed from run" in r.output and "measured on NVIDIA H100 80GB HBM3" in r.output
    cpu = _fake_run(tmp_path / "c", "cpu", "x86_64", None)
    r = CliRunner().invoke(main, ["estimate", str(cpu), "--offer", "RTX 4090:0.44"])
    assert r.exit_code == 1 and "measured on the CPU" in r.output and '"RTX 4090:0.44:SEC_PER_UPDATE"' in r.output
    r = CliRunner().invoke(main, ["estimate", str(cpu), "--offer", "RTX 4090:0.44:1.5"])
    assert r.exit_code == 0 and "measured there" in r.output

"""run.offer (issue 26): the machine a run is paid on. The log rows and progress line carry the cost
so far, the record keeps the training session's cost as `imglora estimate RUN_DIR` computes it
(the two agree to the cent) and the meter's, and the budget guard projects at the offer's rate and
records the cost it stopped at."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from imglora.runs import cost as ec
from imglora.runs import record
from imglora.cli import main
from imglora.commands.common import load_config
from imglora.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-sdxl.toml"


def train_args(small_run, *extra: str) -> list[str]:
    args = ["train", str(PRESET)]
    for o in [*small_run(("01_sky", "02_grass")), "train.log_every=1", "train.warmup_steps=0", *extra]:
        args += ["--set", o]
    return args


def test_the_log_record_and_estimate_agree_on_the_offers_cost(tmp_path: Path, small_run) -> None:
    r = CliRunner().invoke(main, train_args(small_run, "train.max_steps=4", "train.checkpoint_every=2",
                                            'run.offer="RTX 4090 spot:3.6"'))
    assert r.exit_code == 0, r.output
    assert re.search(r"\| 0\.\d\d USD so far", r.output), r.output
    run = tmp_path / "runs" / "tiny-sdxl"
    rows = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    costs = [row["cost"] for row in rows]
    assert len(costs) == 4 and all(c > 0 for c in costs) and costs == sorted(costs)
    rec = record.read_records(run, "train")[-1]
    offer = rec["offer"]
    assert (offer["name"], offer["rate"], offer["currency"]) == ("RTX 4090 spot", 3.6, "USD")
    # The record's cost is the estimate's formula on the record: computed again here from the file.
    again = ec.estimate(ec.session_inputs(ec.from_record(rec), evaluation=0.0), 3.6).cost
    assert offer["cost"] == round(again, 6) and offer["metered"] > 0 and offer["at_budget_stop"] is None
    # ... and `imglora estimate RUN_DIR` takes the run's offer and prints the same cost, to the cent.
    est = CliRunner().invoke(main, ["estimate", str(run)])
    assert est.exit_code == 0, est.output
    assert "rate: 3.6 USD/h, the run's offer 'RTX 4090 spot' (run.offer)" in est.output
    printed = float(re.search(r"cost\s+([\d.]+) USD at 3.6 USD/h", est.output).group(1))
    assert printed == round(offer["cost"], 2)
    assert f"the run's record: {offer['cost']:.2f} USD for the training session" in est.output


def test_the_budget_guard_projects_at_the_offers_rate_and_records_where_it_stopped(tmp_path: Path,
                                                                                   small_run) -> None:
    r = CliRunner().invoke(main, train_args(small_run, "train.max_steps=500", "train.checkpoint_every=0",
                                            "train.budget.smoke_steps=2", "train.budget.max_cost=0.00001",
                                            'run.offer="box:3.6"'))
    assert r.exit_code == 3, r.output
    assert "exceeds train.budget.max_cost = 1e-05 USD" in r.output
    rec = record.read_records(tmp_path / "runs" / "tiny-sdxl", "train")[-1]
    assert rec["offer"]["at_budget_stop"] == round(rec["projection"]["cost"], 6) > 0.00001


def test_a_bad_offer_or_two_rates_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"run.offer: 'box': expected NAME:RATE or NAME:RATE:SEC_PER_UPDATE"):
        load_config(PRESET, ['run.offer="box"'])
    with pytest.raises(ConfigError, match=r"run.offer: its rate 2 differs from train.budget.hourly_rate = 3; give the "
                                          r"rate once"):
        load_config(PRESET, ['run.offer="box:2"', "train.budget.hourly_rate=3"])
    cfg = load_config(PRESET, ['run.offer="A100 80GB:1.89:0.8"', "train.budget.max_cost=5"])  # the rate is the offer's
    assert ec.run_rate(cfg)[:2] == ("A100 80GB", 1.89) and ec.run_rate(cfg)[2].hourly_rate == 1.89

"""Session time and cost: one formula, used before a run (``imglora estimate``), during it (the
budget guard's projection) and after it (checking the projection against what happened).

    session_seconds = setup + cache + optimizer_steps × seconds_per_update + checkpoints + evaluation + idle
    cost            = session_hours × hourly_rate + storage + transfer

Seconds per update means per *optimizer* update, gradient accumulation included. A micro-batch
time or an it/s figure is converted explicitly (``seconds_per_update_from``); the two are never
confused, because multiplying micro-batch time by optimizer steps under-counts by the accumulation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..config.offer import WARMUP_UPDATES, parse_offer, projection_update  # noqa: F401 (re-exported)
from ..errors import ImgloraError

HOURS_PER_MONTH = 730.0
@dataclass(frozen=True)
class SessionInputs:
    setup: float            # seconds: model load, start-up
    cache: float            # seconds: encoding latents and text (0 when the cache is complete)
    steps: int              # optimizer updates
    seconds_per_update: float
    checkpoints: int        # checkpoint saves
    seconds_per_checkpoint: float
    evaluation: float = 0.0
    idle: float = 0.0       # booting, uploading, waiting: whatever the meter runs for besides the work


@dataclass(frozen=True)
class Estimate:
    terms: dict[str, float]  # seconds per term, in formula order
    seconds: float
    hours: float
    compute_cost: float | None
    storage_cost: float
    transfer_cost: float
    cost: float | None
    currency: str
    rate: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Extras:
    storage_gb: float = 0.0
    storage_price_gb_month: float = 0.0
    transfer_gb: float = 0.0
    transfer_price_gb: float = 0.0


def estimate(inputs: SessionInputs, rate: float | None = None, currency: str = "USD",
             extras: Extras = Extras()) -> Estimate:
    if inputs.seconds_per_update <= 0 or not math.isfinite(inputs.seconds_per_update):
        raise ImgloraError(f"seconds per update must be a positive number, got {inputs.seconds_per_update}")
    terms = {
        "setup": inputs.setup,
        "cache": inputs.cache,
        "training": inputs.steps * inputs.seconds_per_update,
        "checkpoints": inputs.checkpoints * inputs.seconds_per_checkpoint,
        "evaluation": inputs.evaluation,
        "idle": inputs.idle,
    }
    seconds = sum(terms.values())
    hours = seconds / 3600
    storage = extras.storage_gb * extras.storage_price_gb_month * hours / HOURS_PER_MONTH
    transfer = extras.transfer_gb * extras.transfer_price_gb
    compute = None if rate is None else hours * rate
    total = None if compute is None else compute + storage + transfer
    return Estimate(terms, seconds, hours, compute, storage, transfer, total, currency, rate)


def seconds_per_update_from(*, its: float | None = None, its_unit: str | None = None,
                            sec_per_micro_batch: float | None = None, grad_accum: int = 1) -> float:
    """Convert a progress bar's it/s (of micro-batches or of updates) or a micro-batch time."""
    if its is not None:
        if its <= 0:
            raise ImgloraError(f"--its must be positive, got {its}")
        if its_unit is None:
            if grad_accum > 1:
                raise ImgloraError(
                    f"--its {its} is ambiguous with gradient accumulation {grad_accum}: say whether the "
                    "log counted micro-batches or optimizer updates (--its-unit micro or --its-unit update)")
            its_unit = "update"
        return (grad_accum if its_unit == "micro" else 1) / its
    if sec_per_micro_batch is not None:
        return sec_per_micro_batch * grad_accum
    raise ImgloraError("give a measured speed: a run folder, a bench result, --sec-per-update, --its, or "
                       "--sec-per-micro-batch")


def steps_for_epochs(epochs: float, dataset_size: int, batch_size: int, grad_accum: int) -> int:
    """Optimizer updates for some epochs: epochs × dataset size ÷ (batch × accumulation), rounded up."""
    if min(dataset_size, batch_size, grad_accum) < 1 or epochs <= 0:
        raise ImgloraError("epochs, dataset size, batch size and accumulation must be positive")
    return math.ceil(epochs * dataset_size / (batch_size * grad_accum))


def checkpoint_count(steps: int, every: int) -> int:
    """Saves during a run: one every ``every`` updates and one at the end."""
    return (steps - 1) // every + 1 if every else 1


# ----------------------------------------------------------------------------------------------
# Inputs from what was measured


@dataclass
class Measured:
    setup: float = 0.0
    cache: float = 0.0
    seconds_per_update: float | None = None
    seconds_per_checkpoint: float = 0.0
    evaluation: float = 0.0
    steps: int | None = None
    checkpoint_every: int = 0
    dataset_size: int | None = None
    batch_size: int = 1
    grad_accum: int = 1
    actual_seconds: float | None = None
    source: str = ""
    device: str | None = None       # where seconds_per_update was measured: "cpu" or "cuda"
    device_name: str | None = None  # e.g. "NVIDIA H100 80GB HBM3"
    processes: int = 1  # data-parallel processes (GPUs) the speed was measured with
    offer: dict[str, Any] | None = None  # the run's run.offer: {"name", "rate", "currency"}


def from_run(run_dir: Path) -> Measured:
    from .record import read_records

    recs = [r for r in read_records(run_dir, "train") if r.get("sec_per_update", {}).get("median")]
    if not recs:
        raise ImgloraError(f"{run_dir}: no finished training record with a measured seconds per update "
                           "(records/*-train.json); train first, or pass --bench or --sec-per-update")
    m = from_record(recs[-1], read_records(run_dir, "eval"))
    m.source = f"run {run_dir}"
    return m


def from_record(r: dict[str, Any], evals: list[dict[str, Any]] | None = None) -> Measured:
    """What a training record (and the run's eval records) measured: the inputs of its session."""
    from datetime import datetime

    ph = r.get("phases", {})
    ckpt = r.get("checkpoint_seconds") or []
    cfg = r["config"]["train"]
    cache = ph.get("cache", 0.0)
    # The final checkpoint, adapter and plots are one more save, measured as finish_seconds.
    saves = ckpt[:-1] + [r.get("finish_seconds", ckpt[-1] if ckpt else 0.0)] if ckpt else []
    m = Measured(
        setup=max(0.0, r.get("setup_seconds", 0.0) - cache),
        cache=cache,
        seconds_per_update=r["sec_per_update"].get("mean") or r["sec_per_update"]["median"],
        seconds_per_checkpoint=sum(saves) / len(saves) if saves else 0.0,
        # The eval record's own duration (key "seconds"; "duration_seconds" in records of imglora 0.1).
        evaluation=(evals[-1].get("seconds") or evals[-1].get("duration_seconds") or 0.0) if evals else 0.0,
        steps=r.get("total_updates"), checkpoint_every=cfg.get("checkpoint_every", 0),
        dataset_size=r.get("dataset_items"), batch_size=cfg["batch_size"], grad_accum=cfg["grad_accum"],
        source="a training record",
        device=r.get("environment", {}).get("device"), device_name=r.get("environment", {}).get("device_name"),
        processes=r.get("processes") or 1, offer=r.get("offer"),
    )
    started, finished = r.get("started"), r.get("finished")
    if started and finished:
        m.actual_seconds = (datetime.fromisoformat(finished) - datetime.fromisoformat(started)).total_seconds()
    return m


def session_inputs(m: Measured, **given: Any) -> SessionInputs:
    """The session of ``m`` as measured, with ``given`` (SessionInputs fields) in place of what was
    measured: the inputs `imglora estimate` and the training record's cost both use."""
    steps = given.pop("steps", None) or m.steps or 0
    every = given.pop("checkpoint_every", None)
    every = m.checkpoint_every if every is None else every
    spu = given.pop("seconds_per_update", None) or m.seconds_per_update
    base = dict(setup=m.setup, cache=m.cache, steps=steps, seconds_per_update=spu,
                checkpoints=checkpoint_count(steps, every), seconds_per_checkpoint=m.seconds_per_checkpoint,
                evaluation=m.evaluation, idle=0.0)
    return SessionInputs(**{**base, **{k: v for k, v in given.items() if v is not None}})


def run_rate(cfg: Any) -> tuple[str | None, float, Any]:
    """(the offer's name or None, the hourly rate a run is billed at, train.budget with that rate):
    train.budget.hourly_rate, else run.offer's rate (the config refuses two different rates); 0.0
    when neither is set. The budget guard projects the cost at that rate."""
    from dataclasses import replace

    name, rate = None, cfg.train.budget.hourly_rate
    if cfg.run.offer:
        name, offered, _ = parse_offer(cfg.run.offer)
        rate = rate or offered
    return name, rate, replace(cfg.train.budget, hourly_rate=rate)


def run_cost(rec: dict[str, Any], offer: str | None, rate: float, currency: str, session_hours: float,
             budget_stop: "Projection | None") -> dict[str, Any]:
    """What a training record keeps of its offer: the name and rate, the training session's cost as
    `imglora estimate RUN_DIR` computes it from this record (``cost``: the same function on the same
    record, so the two agree to the cent), the meter's (``metered``: wall time since set-up), and the
    projected cost at which the budget guard stopped the run, if it did."""
    try:
        cost: float | None = estimate(session_inputs(from_record(rec), evaluation=0.0), rate, currency).cost
    except (ImgloraError, KeyError, TypeError):  # too few updates to have measured one: no estimate
        cost = None
    return {"name": offer, "rate": rate, "currency": currency, "cost": None if cost is None else round(cost, 6),
            "metered": round(session_hours * rate, 6),
            "at_budget_stop": round(budget_stop.cost, 6) if budget_stop and budget_stop.cost is not None else None}


def from_bench(path: Path, setting: str | None = None) -> Measured:
    import json

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ImgloraError(f"--bench {path}: cannot read the bench result ({exc})") from None
    ok = [r for r in data.get("results", []) if r.get("status") == "ok"]
    if setting:
        ok = [r for r in ok if r["setting"] == setting]
    if not ok:
        raise ImgloraError(f"--bench {path}: no successful setting{f' named {setting!r}' if setting else ''}")
    best = min(ok, key=lambda r: r["sec_per_update"]["median"])
    env = best.get("environment") or data.get("environment") or {}
    return Measured(setup=best.get("setup_seconds", 0.0), seconds_per_update=best["sec_per_update"]["median"],
                    grad_accum=data.get("grad_accum", 1), batch_size=data.get("batch_size", 1),
                    source=f"bench {path} (setting {best['setting']})", device=env.get("device"),
                    device_name=env.get("device_name"))


def format_estimate(est: Estimate, steps: int, seconds_per_update: float) -> str:
    lines = []
    labels = {"setup": "setup (model load)", "cache": "cache (encoding)",
              "training": f"training ({steps} updates × {seconds_per_update:.3f} s)",
              "checkpoints": "checkpoints", "evaluation": "evaluation", "idle": "idle"}
    width = max(len(v) for v in labels.values())
    for key, secs in est.terms.items():
        share = 100 * secs / est.seconds if est.seconds else 0.0
        lines.append(f"  {labels[key]:<{width}}  {_hms(secs):>9}  {share:5.1f} %")
    lines.append(f"  {'session':<{width}}  {_hms(est.seconds):>9}  ({est.hours:.3f} h)")
    if est.cost is not None:
        extra = ""
        if est.storage_cost or est.transfer_cost:
            extra = f" (compute {est.compute_cost:.2f} + storage {est.storage_cost:.2f} + transfer {est.transfer_cost:.2f})"
        lines.append(f"  {'cost':<{width}}  {est.cost:9.2f} {est.currency} at {est.rate:g} {est.currency}/h{extra}")
    return "\n".join(lines)


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


# ----------------------------------------------------------------------------------------------
# The budget guard's projection, made during training after the smoke steps


@dataclass(frozen=True)
class Projection:
    at_step: int
    seconds_per_update: float
    elapsed: float           # seconds since the run started (setup, cache, updates so far)
    remaining_updates: int
    remaining_checkpoints: int
    seconds_per_checkpoint: float
    seconds: float           # projected session total
    cost: float | None
    over: str | None         # why the projection exceeds the budget, or None
    fits_steps: int | None   # the largest max_steps that would fit the budget

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self, currency: str) -> str:
        cost = f", {self.cost:.2f} {currency}" if self.cost is not None else ""
        return (f"projection after {self.at_step} updates: session {_hms(self.seconds)}{cost} "
                f"({self.remaining_updates} updates left × {self.seconds_per_update:.3f} s, "
                f"{self.remaining_checkpoints} checkpoints × {self.seconds_per_checkpoint:.1f} s)")

    def stop_advice(self, currency: str, step: int, total: int) -> str:
        """Why the budget guard stopped at ``step`` of ``total``, in one sentence, and what would fit:
        how many updates the budget allows (or that none more do)."""
        cost = f" and cost {self.cost:.2f} {currency}" if self.cost is not None else ""
        head = (f"stopped by the budget guard at update {step}/{total}: measured over the first {self.at_step} "
                f"updates, the whole session would take {_hms(self.seconds)}{cost} ({self.over})")
        if self.fits_steps is not None and self.fits_steps > step:
            return (f"{head}. The budget fits {self.fits_steps} updates in all: set train.max_steps to "
                    f"{self.fits_steps} or less")
        return f"{head}. No further updates fit the budget: raise that limit to train more"


def project(budget: Any, *, step: int, total: int, elapsed: float, seconds_per_update: float,
            checkpoint_every: int, seconds_per_checkpoint: float) -> Projection:
    remaining = total - step
    ckpts = len([s for s in range(step + 1, total) if checkpoint_every and s % checkpoint_every == 0]) + 1
    seconds = elapsed + remaining * seconds_per_update + ckpts * seconds_per_checkpoint
    cost = seconds / 3600 * budget.hourly_rate if budget.hourly_rate else None
    limit = None  # seconds the budget allows
    over = None
    if budget.max_hours and seconds > budget.max_hours * 3600:
        over, limit = f"{seconds / 3600:.2f} h exceeds train.budget.max_hours = {budget.max_hours:g}", budget.max_hours * 3600
    if budget.max_cost and cost is not None and cost > budget.max_cost:
        cost_limit = budget.max_cost / budget.hourly_rate * 3600
        if limit is None or cost_limit < limit:
            limit = cost_limit
        over = (f"{cost:.2f} {budget.currency} exceeds train.budget.max_cost = {budget.max_cost:g} "
                f"{budget.currency}" + (f"; {over}" if over else ""))
    fits = None
    if limit is not None:
        fits = max(0, step + int((limit - elapsed - ckpts * seconds_per_checkpoint) // seconds_per_update))
    return Projection(step, seconds_per_update, elapsed, remaining, ckpts, seconds_per_checkpoint, seconds, cost,
                      over, fits)

"""``imglora estimate``: session time and cost from measured phases, term by term, per GPU offer."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import click

from ..runs import cost as ec
from ..errors import ImgloraError


def estimate(run_dir: str | None, bench_file: str | None, setting: str | None, steps: int | None,
             epochs: float | None, dataset_size: int | None, batch_size: int | None, accum: int | None,
             sec_per_update: float | None, sec_per_micro_batch: float | None, its: float | None,
             its_unit: str | None, setup: float | None, cache_s: float | None, checkpoint_every: int | None,
             sec_per_checkpoint: float | None, eval_seconds: float | None, idle_minutes: float, rate: float | None,
             currency: str, storage: str | None, transfer: str | None, offers: tuple[str, ...],
             echo: Callable[[str], Any] = click.echo, gpus: int | None = None) -> None:
    if run_dir:
        m = ec.from_run(Path(run_dir))
    elif bench_file:
        m = ec.from_bench(Path(bench_file), setting)
    else:
        m = ec.Measured(source="the command line")
    accum = accum or m.grad_accum
    batch_size = batch_size or m.batch_size
    spu = sec_per_update or (ec.seconds_per_update_from(its=its, its_unit=its_unit,
                                                        sec_per_micro_batch=sec_per_micro_batch, grad_accum=accum)
                             if its or sec_per_micro_batch else m.seconds_per_update)
    if spu is None:
        raise ImgloraError("no seconds per update: give a run folder, --bench, --sec-per-update, --its or "
                           "--sec-per-micro-batch")
    if epochs is not None:
        size = dataset_size or m.dataset_size
        if not size:
            raise ImgloraError("--epochs needs --dataset-size (images per epoch, with repeats)")
        steps = ec.steps_for_epochs(epochs, size, batch_size, accum)
    steps = steps or m.steps
    if not steps:
        raise ImgloraError("how many updates? give --steps, or --epochs with --dataset-size")
    inputs = ec.session_inputs(m, steps=steps, seconds_per_update=spu, checkpoint_every=checkpoint_every, setup=setup,
                               cache=cache_s, seconds_per_checkpoint=sec_per_checkpoint, evaluation=eval_seconds,
                               idle=idle_minutes * 60)
    extras = ec.Extras(*_pair(storage, "--storage"), *_pair(transfer, "--transfer"))
    if rate is None and m.offer:  # the run named its offer (run.offer): its rate, as the run's record counted it
        rate, currency = m.offer["rate"], m.offer.get("currency", currency)
        echo(f"rate: {rate:g} {currency}/h, the run's offer {m.offer['name']!r} (run.offer)")
    est = ec.estimate(inputs, rate, currency, extras)
    procs = gpus or m.processes
    per_gpu = f" × {procs} processes" if procs > 1 else ""
    echo(f"session estimate from {m.source}: {steps} updates, batch {batch_size} × accumulation {accum}{per_gpu}")
    echo(ec.format_estimate(est, steps, spu))
    if procs > 1:
        echo(f"  GPU-hours: {est.hours * procs:.3f} ({procs} GPUs × {est.hours:.3f} h; the rate is per machine)")
        if gpus and gpus != m.processes and not (sec_per_update or its or sec_per_micro_batch):
            echo(f"  note: the speed was measured with {m.processes} process(es), not {gpus}: scaling not measured; "
                 f"train a few updates with --gpus {gpus} (or bench there) and estimate from that run")
    if m.offer and m.offer.get("cost") is not None:
        echo(f"  the run's record: {m.offer['cost']:.2f} {m.offer.get('currency', currency)} for the training session "
             f"at {m.offer['rate']:g}/h (metered: {m.offer['metered']:.2f})")
    if m.actual_seconds and steps == m.steps and idle_minutes == 0:
        err = 100 * (est.seconds - m.actual_seconds) / m.actual_seconds
        echo(f"  measured session of that run: {m.actual_seconds:.1f} s (estimate {err:+.1f} %)")
    speed_source = ("--sec-per-update" if sec_per_update else "--its" if its else "--sec-per-micro-batch"
                    if sec_per_micro_batch else m.source)
    for offer in offers:
        name, offer_rate, offer_spu = _offer(offer)
        if offer_spu is None and not (sec_per_update or its or sec_per_micro_batch) and m.device == "cpu":
            raise ImgloraError(f"--offer {offer!r} gives no seconds per update, and the only measured speed ({m.source}) "
                               f"was measured on the CPU ({m.device_name}), which says nothing about a GPU offer; "
                               f"write it as \"{name}:{offer_rate:g}:SEC_PER_UPDATE\" with a speed measured on that "
                               "GPU (imglora bench-swap there), or pass --sec-per-update")
        o = ec.estimate(ec.SessionInputs(**{**vars(inputs), "seconds_per_update": offer_spu or spu}), offer_rate,
                        currency, extras)
        if offer_spu:
            basis = "measured there"
        else:
            where = f", measured on {m.device_name}" if m.device_name and speed_source == m.source else ""
            basis = f"assumes the speed from {speed_source}{where}"
        echo(f"  offer {name}: {o.hours:.2f} h, {o.cost:.2f} {currency} ({offer_rate:g} {currency}/h, "
                   f"{offer_spu or spu:.3f} s/update, {basis})")


def _pair(text: str | None, flag: str) -> tuple[float, float]:
    if not text:
        return 0.0, 0.0
    try:
        a, b = (float(x) for x in text.split(":"))
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected two numbers as A:B, e.g. 100:0.10", param_hint=flag) from None
    if not all(math.isfinite(x) and x >= 0 for x in (a, b)):
        raise click.BadParameter(f"{text!r}: both numbers must be finite and not negative", param_hint=flag)
    return a, b


def _offer(text: str) -> tuple[str, float, float | None]:
    try:
        return ec.parse_offer(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--offer") from None



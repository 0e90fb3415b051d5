"""The ``imglora`` command line. Each command parses, loads the config, and calls one function."""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
from pathlib import Path

import click

from . import __version__
from .errors import ImgloraError

SET_HELP = "Override a preset key, e.g. --set train.max_steps=100 (repeatable)."


class _Group(click.Group):
    """Turns user errors into a clear message and an exit code, never a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ImgloraError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100,
                                           "terminal_width": 100})
@click.version_option(__version__, prog_name="imglora")
@click.option("-v", "--verbose", is_flag=True, help="Show debug logging.")
def main(verbose: bool) -> None:
    """LoRA training for SDXL and FLUX.1-dev on rented GPUs: least memory and time, cost known
    before you pay, adapters ready for ComfyUI."""
    # Library chatter (per-file progress bars, optional-dependency notices) would drown imglora's
    # own progress; set before those libraries are imported, and only where the user has not.
    if not verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from .progress import is_tty

    # Logs written to a file or pipe get the time of each line, as imglora's own lines do.
    fmt = "%(levelname)s %(name)s: %(message)s" if is_tty(sys.stderr) else "[%(asctime)s] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=fmt, datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "filelock", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _load(preset: str, overrides: tuple[str, ...]):
    from . import config

    return config.load(preset, overrides)


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@main.command("config", short_help="Check a preset and print the resolved config as TOML.")
@click.argument("preset", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--keys", is_flag=True, help="List every key with its default and meaning instead.")
def config_cmd(preset: str, overrides: tuple[str, ...], keys: bool) -> None:
    """Check a preset and print the resolved configuration as TOML."""
    from . import config

    if keys:
        for key, default, help_ in config.field_help():
            click.echo(f"{key} = {default}\n    {help_}")
        return
    click.echo(_load(preset, overrides).to_toml(), nl=False)


@main.command("cache-latents", short_help="Encode latents and text embeddings once into the cache.")
@click.argument("preset", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--verify", is_flag=True, help="Re-check every cache entry and report stale, missing or corrupt ones.")
def cache_latents_cmd(preset: str, overrides: tuple[str, ...], verify: bool) -> None:
    """Encode VAE latents and text-encoder outputs once, into the content-keyed cache."""
    from . import record
    from .data import cache
    from .data.dataset import dataset_version
    from .families import get_family
    from .models import resolve_model

    from .atomic import check_writable

    cfg = _load(preset, overrides)
    family = get_family(cfg.model.family)
    device = _device()
    if not verify:
        check_writable(cfg.cache.dir, "cache.dir")
    rec = record.RunRecord("cache-latents", cfg.run_dir, cfg.to_dict())
    with rec.phase("resolve_model"):
        model_dir = resolve_model(cfg.model.path, cfg.model.family)
    with rec.phase("scan"):
        scanned = cache.scan(cfg, family)
    for w in scanned.warnings:
        click.echo(f"warning: {w}", err=True)
    if verify:
        report = cache.verify(cfg, family, model_dir, device)
        click.echo(f"{report.ok} entries ok, {len(report.missing)} missing, {len(report.stale)} stale, "
                   f"{len(report.corrupt)} corrupt")
        for label, rows in (("missing", report.missing), ("stale", report.stale), ("corrupt", report.corrupt)):
            for row in rows:
                click.echo(f"  {label}: {row}")
        if report.missing or report.corrupt:
            click.echo("run `imglora cache-latents` again to encode missing and corrupt entries", err=True)
            sys.exit(1)
        return
    with rec.phase("cache"):
        the_plan, stats = cache.fill_cache(cfg, family, model_dir, device)
    click.echo(f"latents: {stats.latents_encoded} encoded, {stats.latents_reused} reused; "
               f"text: {stats.texts_encoded} encoded, {stats.texts_reused} reused; "
               f"{stats.seconds:.2f} s (cache in {cfg.cache.dir})")
    with rec.phase("checksums"):
        rec.set(model_dir=str(model_dir), model_checksums=record.folder_checksums(model_dir),
                dataset_version=dataset_version(cache.split_holdout(cfg, scanned)[0].items),
                dataset_items=len(scanned.items),
                cache_identities=the_plan.identities,
                cache_stats={k: v for k, v in vars(stats).items()})
    path = rec.write()
    click.echo(f"record: {path}")


@main.command("train", short_help="Train a LoRA: cache, train, checkpoint, adapter, record.")
@click.argument("preset", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint of the run folder.")
def train_cmd(preset: str, overrides: tuple[str, ...], resume: bool) -> None:
    """Train a LoRA adapter: cache, train, checkpoint, write the adapter and run record."""
    import shlex

    from .progress import stamped
    from .train import train

    cfg = _load(preset, overrides)
    command = shlex.join(["imglora", "train", preset, *[x for o in overrides for x in ("--set", o)]])
    result = train(cfg, resume=resume, command=command, out=stamped(click.echo))
    # Interrupted runs exit as a shell reports a process killed by that signal (128 + number), so a
    # scheduler sees "interrupted, resumable" rather than success; the checkpoint is written first.
    if result.interrupted and result.signal in ("SIGINT", "SIGTERM"):
        sys.exit(128 + int(getattr(signal, result.signal)))
    if result.signal == "budget":
        sys.exit(3)  # stopped by the budget guard: the work is saved, but the run is not finished


@main.command("export", short_help="Write a ComfyUI-ready .safetensors and ComfyUI workflows.")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--checkpoint", default="latest", show_default=True,
              help="latest, final, or a checkpoint's update number.")
@click.option("--comfyui", "comfyui", type=click.Path(file_okay=False), default=None,
              help="ComfyUI folder: writes models/loras/<name>.safetensors (honours extra_model_paths.yaml).")
@click.option("--out", type=click.Path(), default=None, help="Write to this file (or folder) instead.")
@click.option("--name", default=None, help="File name without extension; default: the run's name.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="Precision of the exported tensors; default: the preset's export.dtype (bf16).")
@click.option("--format", "fmt", type=click.Choice(["default", "kohya"]), default=None,
              help="Key layout; default: kohya form for SDXL, diffusers form for FLUX (both load in ComfyUI).")
@click.option("--force", is_flag=True, help="Replace an existing file.")
def export_cmd(run_dir: str, checkpoint: str, comfyui: str | None, out: str | None, name: str | None,
               dtype: str | None, fmt: str | None, force: bool) -> None:
    """Write a ComfyUI-ready .safetensors (and two ComfyUI workflows) from a run."""
    from .export import export

    r = export(Path(run_dir), checkpoint=checkpoint, comfyui=Path(comfyui) if comfyui else None,
               out=Path(out) if out else None, name=name, dtype=dtype, fmt=fmt, force=force)
    click.echo(f"exported {r.n_tensors} tensors ({r.format} form, {r.source}) to {r.path}")
    click.echo(f"ComfyUI workflow: {r.workflow_ui} (drag onto the ComfyUI window); API form: {r.workflow_api}")


@main.command("bench-swap", short_help="Measure s/update and peak memory per block-swap setting.")
@click.argument("preset", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--blocks", default="0,9,18,27", show_default=True,
              help="Swap settings (kohya count), e.g. 0,9,18 or fp8:18,bf16:0 to compare precisions too.")
@click.option("--fp8/--no-fp8", "fp8", default=None, help="FP8 base for bare numbers in --blocks (default: the preset's).")
@click.option("--steps", default=12, show_default=True, type=click.IntRange(min=1),
              help="Measured optimizer updates per setting.")
@click.option("--warmup", default=3, show_default=True, type=click.IntRange(min=0), help="Updates before measuring.")
@click.option("--resolution", type=click.IntRange(min=16), help="Square training resolution (default: the preset's).")
@click.option("--vram-budget", help="Name the fastest setting whose peak reserved memory fits, e.g. 24GB.")
@click.option("--arch", type=click.Choice(["preset", "full"]), default="preset", show_default=True,
              help="full: the real FLUX.1-dev / SDXL architecture with random weights (no download).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Folder for bench.json/csv/png.")
@click.option("--timeout", default=3600, show_default=True, type=click.IntRange(min=1),
              help="Seconds allowed per setting.")
def bench_swap_cmd(preset, overrides, blocks, fp8, steps, warmup, resolution, vram_budget, arch, out_dir, timeout):
    """Measure seconds per update and peak memory for several swap settings; name the fastest that fits."""
    from . import bench, config
    from .progress import stamped

    cfg = config.load(preset, overrides)
    settings = bench.parse_settings(blocks, cfg.memory.fp8 if fp8 is None else fp8)
    bench.bench_swap(preset, overrides, settings, steps=steps, warmup=warmup, resolution=resolution,
                     vram_budget=bench.parse_size(vram_budget), arch=arch, out_dir=Path(out_dir) if out_dir else None,
                     timeout=timeout, out=stamped(click.echo))


class _Number(click.ParamType):
    """A finite number within bounds; NaN, infinity and out-of-range values exit 2 naming the option."""

    name = "number"

    def __init__(self, minimum: float = 0.0, open_min: bool = False, integer: bool = False):
        self.minimum, self.open_min, self.integer = minimum, open_min, integer
        self.name = "integer" if integer else "number"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = value
        else:
            try:
                number = int(value) if self.integer else float(value)
            except ValueError:
                self.fail(f"{value!r} is not {'an integer' if self.integer else 'a number'}", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if number < self.minimum or (self.open_min and number == self.minimum):
            bound = "greater than" if self.open_min else "at least"
            self.fail(f"{value} must be {bound} {self.minimum:g}", param, ctx)
        return number


POSITIVE = _Number(0.0, open_min=True)
NON_NEGATIVE = _Number(0.0)
COUNT = _Number(1, integer=True)
NON_NEGATIVE_INT = _Number(0, integer=True)


@main.command("estimate", short_help="Session time and cost from measured phases and offers.")
@click.argument("run_dir", type=click.Path(file_okay=False), required=False)
@click.option("--bench", "bench_file", type=click.Path(dir_okay=False), help="Use a bench-swap result (bench.json).")
@click.option("--setting", help="With --bench: the setting to use (default: the fastest that ran).")
@click.option("--steps", type=COUNT, help="Optimizer updates to plan for (default: the run's).")
@click.option("--epochs", type=POSITIVE, help="Plan for epochs instead: steps = epochs × dataset size ÷ (batch × accum).")
@click.option("--dataset-size", type=COUNT, help="Images (with repeats) per epoch, for --epochs.")
@click.option("--batch-size", type=COUNT, help="Micro-batch size (default: the run's).")
@click.option("--accum", type=COUNT, help="Gradient accumulation (default: the run's).")
@click.option("--sec-per-update", type=POSITIVE, help="Measured seconds per optimizer update.")
@click.option("--sec-per-micro-batch", type=POSITIVE, help="Measured seconds per micro-batch (× accumulation).")
@click.option("--its", type=POSITIVE, help="it/s read from a training log's progress bar.")
@click.option("--its-unit", type=click.Choice(["micro", "update"]), help="What that progress bar counted.")
@click.option("--setup", type=NON_NEGATIVE, help="Seconds of set-up (model load); default: measured.")
@click.option("--cache", "cache_s", type=NON_NEGATIVE, help="Seconds of caching; default: measured (0 with a full cache).")
@click.option("--checkpoint-every", type=NON_NEGATIVE_INT, help="Updates between checkpoints (default: the run's).")
@click.option("--sec-per-checkpoint", type=NON_NEGATIVE, help="Seconds per checkpoint save; default: measured.")
@click.option("--eval-seconds", type=NON_NEGATIVE, help="Seconds of evaluation; default: measured.")
@click.option("--idle-minutes", type=NON_NEGATIVE, default=0.0, show_default=True,
              help="Minutes the meter runs besides the work (boot, upload, download).")
@click.option("--rate", type=NON_NEGATIVE, help="Hourly price of the machine.")
@click.option("--currency", default="USD", show_default=True)
@click.option("--storage", help="GB:PRICE_PER_GB_MONTH of disk billed while the session runs.")
@click.option("--transfer", help="GB:PRICE_PER_GB of data transfer.")
@click.option("--offer", "offers", multiple=True, metavar="NAME:RATE[:SEC_PER_UPDATE]",
              help="Compare machines: hourly rate and, when measured there, seconds per update (repeatable). "
                   "Without SEC_PER_UPDATE the offer assumes the speed this estimate uses, measured on the device "
                   "it names; that is refused when it was measured on a CPU.")
def estimate_cmd(run_dir, bench_file, setting, steps, epochs, dataset_size, batch_size, accum, sec_per_update,
                 sec_per_micro_batch, its, its_unit, setup, cache_s, checkpoint_every, sec_per_checkpoint,
                 eval_seconds, idle_minutes, rate, currency, storage, transfer, offers) -> None:
    """Session time and cost from measured phases: where the time goes, and what it costs per offer."""
    from . import economics as ec
    from .errors import ImgloraError

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
    every = m.checkpoint_every if checkpoint_every is None else checkpoint_every
    inputs = ec.SessionInputs(
        setup=m.setup if setup is None else setup, cache=m.cache if cache_s is None else cache_s, steps=steps,
        seconds_per_update=spu, checkpoints=ec.checkpoint_count(steps, every),
        seconds_per_checkpoint=m.seconds_per_checkpoint if sec_per_checkpoint is None else sec_per_checkpoint,
        evaluation=m.evaluation if eval_seconds is None else eval_seconds, idle=idle_minutes * 60)
    extras = ec.Extras(*_pair(storage, "--storage"), *_pair(transfer, "--transfer"))
    est = ec.estimate(inputs, rate, currency, extras)
    click.echo(f"session estimate from {m.source}: {steps} updates, batch {batch_size} × accumulation {accum}")
    click.echo(ec.format_estimate(est, steps, spu))
    if m.actual_seconds and steps == m.steps and idle_minutes == 0:
        err = 100 * (est.seconds - m.actual_seconds) / m.actual_seconds
        click.echo(f"  measured session of that run: {m.actual_seconds:.1f} s (estimate {err:+.1f} %)")
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
        click.echo(f"  offer {name}: {o.hours:.2f} h, {o.cost:.2f} {currency} ({offer_rate:g} {currency}/h, "
                   f"{offer_spu or spu:.3f} s/update, {basis})")


def _pair(text: str | None, flag: str) -> tuple[float, float]:
    from .errors import ImgloraError

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
    from .errors import ImgloraError

    parts = text.rsplit(":", 2)
    try:
        if len(parts) == 3 and _is_number(parts[1]):
            name, rate, spu = parts[0], float(parts[1]), float(parts[2])
        else:
            name, rate_text = text.rsplit(":", 1)
            rate, spu = float(rate_text), None
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected NAME:RATE or NAME:RATE:SEC_PER_UPDATE, e.g. "
                                 "\"RTX 4090:0.44:2.1\"", param_hint="--offer") from None
    if not math.isfinite(rate) or rate < 0 or (spu is not None and (not math.isfinite(spu) or spu <= 0)):
        raise click.BadParameter(f"{text!r}: the rate must be a finite number >= 0 and the seconds per update "
                                 "a finite number > 0", param_hint="--offer")
    return name, rate, spu


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _register_split_commands() -> None:
    from .cli_eval import eval_cmd
    from .cli_llm import merge_cmd

    main.add_command(eval_cmd, "eval")
    main.add_command(merge_cmd, "merge")


_register_split_commands()

if __name__ == "__main__":  # pragma: no cover
    main()

"""The ``imglora`` command line. Each command parses, loads the config, and calls one function."""

from __future__ import annotations

import logging
import os
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


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _load(preset: str, overrides: tuple[str, ...]):
    from . import config

    return config.load(preset, overrides)


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@main.command("config")
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


@main.command("cache-latents")
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

    cfg = _load(preset, overrides)
    family = get_family(cfg.model.family)
    device = _device()
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
                dataset_version=dataset_version(scanned.items), dataset_items=len(scanned.items),
                cache_identities=the_plan.identities,
                cache_stats={k: v for k, v in vars(stats).items()})
    path = rec.write()
    click.echo(f"record: {path}")


@main.command("train")
@click.argument("preset", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint of the run folder.")
def train_cmd(preset: str, overrides: tuple[str, ...], resume: bool) -> None:
    """Train a LoRA adapter: cache, train, checkpoint, write the adapter and run record."""
    from .train import train

    cfg = _load(preset, overrides)
    result = train(cfg, resume=resume, preset=preset, out=lambda s: click.echo(s))
    if result.interrupted and result.signal == "SIGINT":
        sys.exit(130)


@main.command("export")
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


if __name__ == "__main__":  # pragma: no cover
    main()

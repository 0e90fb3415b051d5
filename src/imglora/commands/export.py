"""``imglora export``: the run's adapter as a ComfyUI-ready LoRA, with its workflows."""

from __future__ import annotations

from pathlib import Path

from .. import config
from ..export import writer as exporting
from ..errors import ImgloraError
from ..family import Exportable, Mergeable, supports
from ..families import registry
from .common import family_of, saved_config


def export(run_dir: Path, *, checkpoint: str = "latest", comfyui: Path | None = None, out: Path | None = None,
           name: str | None = None, dtype: str | None = None, fmt: str | None = None,
           force: bool = False, weights: str = "auto") -> exporting.ExportResult:
    """Export a run's adapter for ComfyUI (and diffusers), with two ComfyUI workflows beside it.

    ``checkpoint``: "latest" (the newest of the final adapter and the checkpoints), "final", or a
    step number; ``weights``: raw, ema (train.ema's moving average) or auto (ema when the run kept
    one); the rest as :func:`imglora.export.export`.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ImgloraError(f"{run_dir}: no such run folder; give the folder `imglora train` wrote (runs/<name>)")
    cfg = saved_config(run_dir)
    family = family_of(cfg)
    if not supports(family, Exportable):
        merge = (f", or `imglora merge {run_dir} --out DIR` for a merged model" if supports(family, Mergeable)
                 else "")
        raise ImgloraError(f"{run_dir} trained a {family.name} model; export writes image-model LoRAs for ComfyUI. "
                           f"Use its adapter {run_dir / 'adapter'} as it is, {family.adapter_format}{merge}")
    source = exporting.find_source(run_dir, checkpoint, family.adapter_file, weights)
    # The exported adapter's own settings (a checkpoint's may predate the run's newest record).
    cfg = config.from_dict(source.config, registry, source=f"{source.label} of {run_dir}")
    return exporting.export(run_dir, family, source, cfg, comfyui=comfyui, out=out, name=name, dtype=dtype,
                            fmt=fmt, force=force)

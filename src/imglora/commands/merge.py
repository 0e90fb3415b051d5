"""``imglora merge``: fold a run's adapter into its full-precision base, where the family can."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import ImgloraError
from ..family import Mergeable, supports
from ..families import registry
from .common import family_of, saved_config


def merge(run_dir: str | Path, out: str | Path, *, which: str | None = None, dtype: str = "auto",
          force: bool = False, log: Callable[[str], None] = print) -> Path:
    run_dir = Path(run_dir)
    cfg = saved_config(run_dir)
    family = family_of(cfg)
    if not supports(family, Mergeable):
        able = ", ".join(registry.supporting(Mergeable))
        raise ImgloraError(f"{run_dir} trained a {family.name} model; merge is for {able} runs (image adapters load "
                           "as they are in diffusers and ComfyUI: see `imglora export`)")
    return family.merge(run_dir, cfg, Path(out), which=which, dtype=dtype, force=force, log=log)

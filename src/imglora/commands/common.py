"""What several commands share: reading a preset or a run's saved configuration with the installed
families, and the family a configuration names."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

from .. import config
from ..runs import record
from ..training.checkpoint import list_checkpoints
from ..errors import ImgloraError
from ..families import registry


def load_config(preset: str | Path, overrides: typing.Sequence[str] = ()) -> config.Config:
    """A preset with ``--set`` overrides, checked against the installed families."""
    return config.load(preset, overrides, registry)


def family_of(cfg: config.Config) -> Any:
    return registry.get(cfg.model.family)


def saved_config(run_dir: Path, overrides: typing.Sequence[str] = ()) -> config.Config:
    """The configuration a run was trained with: its newest train record's, else its newest
    checkpoint's (copied checkpoints only), migrated to this schema."""
    records = record.read_records(run_dir, "train")
    data = records[-1]["config"] if records else None
    if data is None:
        ckpts = list_checkpoints(run_dir)
        if not ckpts:
            raise ImgloraError(f"{run_dir}: not a run folder (no records/*-train.json and no checkpoints/); "
                               "give the folder `imglora train` wrote, e.g. runs/<name>")
        data = json.loads((ckpts[-1][1] / "state.json").read_text())["config"]
    return config.from_dict(data, registry, source=f"{run_dir} (train record)", overrides=overrides)

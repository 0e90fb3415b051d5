"""Experiment trackers (``run.log_with``) through accelerate: TensorBoard and Weights & Biases.

Both write into the run folder: TensorBoard events in ``<run>/tensorboard/``, wandb in
``<run>/wandb/`` (offline unless ``run.wandb_mode = "online"``, so a run never needs the network;
``wandb sync <run>/wandb/offline-run-*`` uploads it later). Training logs, per log interval, the
loss, learning rate, seconds per update, peak memory (device, and host RSS) and the gradient norm
under ``train/``, the validation loss under ``val/``; ``imglora eval`` adds its held-out and
training-image losses and its contact sheets under ``eval/`` to the same run: wandb's run id is
kept in ``<run>/trackers.json``, so a resumed run and the evaluation pass continue the run.
"""

from __future__ import annotations

import json
import secrets
import string
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..util import atomic
from ..errors import ImgloraError

if TYPE_CHECKING:
    from PIL import Image

    from ..config import Config

IDS_FILE = "trackers.json"


def for_run(cfg: "Config", run_dir: Path) -> list[Any]:
    """accelerate tracker objects for ``run.log_with`` writing into ``run_dir`` ([] when none)."""
    from importlib.util import find_spec

    missing = [name for name in cfg.run.log_with if find_spec(name) is None]
    if missing:
        raise ImgloraError(f"run.log_with = {json.dumps(list(cfg.run.log_with))} needs {', '.join(missing)}: "
                           f"`pip install {' '.join(missing)}`")
    out: list[Any] = []
    if "tensorboard" in cfg.run.log_with:
        from accelerate.tracking import TensorBoardTracker

        out.append(TensorBoardTracker("tensorboard", str(run_dir)))
    if "wandb" in cfg.run.log_with:
        import wandb
        from accelerate.tracking import WandBTracker

        out.append(WandBTracker(cfg.run.wandb_project, name=cfg.run.name, id=_wandb_id(run_dir), resume="allow",
                                dir=str(run_dir), mode=cfg.run.wandb_mode, settings=wandb.Settings(silent=True)))
    return out


def _wandb_id(run_dir: Path) -> str:
    """The run's wandb id, made once and kept in the run folder."""
    path = Path(run_dir) / IDS_FILE
    try:
        ids = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        ids = {}
    if "wandb" not in ids:  # 8 of [a-z0-9], as wandb makes them
        ids["wandb"] = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        atomic.write_json(path, ids)
    return ids["wandb"]


class Trackers:
    """The started trackers of one process (training, or the evaluation pass)."""

    def __init__(self, accelerator: Any, cfg: "Config", kind: str):
        self.accelerator, self.kind = accelerator, kind
        accelerator.init_trackers(cfg.run.wandb_project, config=_flat(cfg.to_dict()) if kind == "train" else None)
        wandb = self._get("wandb")
        if wandb is not None:  # the evaluation's figures are by checkpoint, logged after training's updates
            wandb.define_metric("eval/*", step_metric="eval/update")

    def _get(self, name: str) -> Any:
        return next((t.tracker for t in self.accelerator.trackers if t.name == name), None)

    def scalars(self, values: dict[str, float | None], step: int) -> None:
        values = {k: float(v) for k, v in values.items() if v is not None}
        for t in self.accelerator.trackers:
            if t.name == "wandb" and self.kind == "eval":  # wandb's own step only grows: training's
                t.log({**values, "eval/update": step})
            else:
                t.log(values, step=step)

    def images(self, name: str, images: list["Image.Image"], step: int) -> None:
        import numpy as np

        arrays = [np.asarray(im.convert("RGB")) for im in images]
        for t in self.accelerator.trackers:
            if t.name == "tensorboard":
                t.log_images({name: np.stack(arrays)}, step=step, dataformats="NHWC")
            elif t.name == "wandb":
                import wandb

                t.log({name: [wandb.Image(a) for a in arrays], "eval/update": step})

    def close(self) -> None:
        self.accelerator.end_training()


def start(accelerator: Any, cfg: "Config", kind: str) -> Trackers | None:
    """The trackers ``accelerator`` was made with (``loop.accelerator_for(cfg, for_run(...))``), started."""
    return Trackers(accelerator, cfg, kind) if cfg.run.log_with else None


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The configuration as flat scalars (hyperparameters): lists and tables as JSON text."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "optimizer_args":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
    return out

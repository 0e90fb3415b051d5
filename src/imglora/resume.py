"""What ``--resume`` checks and restores, and what a new run refuses.

Everything that can refuse a run is checked before any model is loaded (GPU time costs): the
newest readable checkpoint whose settings match (a damaged one is reported and skipped), the
dataset's content, that a new run does not write into a folder holding an earlier one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from . import checkpoint, loop, optimizers
from .errors import ImgloraError

if TYPE_CHECKING:
    from .config import Config


def refuse_existing_run(run_dir: Path, command: str) -> None:
    """A new run never writes over an earlier one's checkpoints, log or adapter."""
    ckpts = checkpoint.list_checkpoints(run_dir)
    if ckpts or (run_dir / "adapter").exists():
        newest = f" (newest checkpoint: update {ckpts[-1][0]})" if ckpts else ""
        raise ImgloraError(
            f"{run_dir} already holds a run{newest}. Continue it with `{command} --resume`, or start a new one "
            "under another name: --set run.name=<new name>")


def check_dependencies(cfg: "Config") -> None:
    """Packages the settings need, all named in one error with the one ``pip install`` that brings
    them, before any model is loaded; nf4 also needs CUDA."""
    from importlib.util import find_spec

    needs: list[tuple[str, str]] = []  # (setting, package)
    if package := optimizers.missing_package(cfg):
        needs.append((f'train.optimizer = "{cfg.train.optimizer}"', package))
    for tracker in cfg.run.log_with:
        if find_spec(tracker) is None:
            needs.append((f'run.log_with = {json.dumps(list(cfg.run.log_with))}', tracker))
    nf4 = cfg.memory.quantization == "nf4"
    if nf4 and find_spec("bitsandbytes") is None:
        needs.append(('memory.quantization = "nf4"', "bitsandbytes"))
    if needs:
        what = "; ".join(f"{setting} needs {package}" for setting, package in needs)
        packages = " ".join(dict.fromkeys(package for _, package in needs))
        instead = ', or set memory.quantization = "qint4"' if nf4 else ""
        raise ImgloraError(f"{what}: `pip install {packages}`{instead}")
    if nf4 and not torch.cuda.is_available():
        raise ImgloraError('memory.quantization = "nf4" needs a CUDA GPU; on this machine set memory.quantization = '
                           '"qint4"')


def resume_point(run_dir: Path, cfg: "Config", families: Any) -> dict[str, Any]:
    """The newest readable checkpoint whose settings match; a broken one is reported and skipped."""
    ckpts = checkpoint.list_checkpoints(run_dir)
    if not ckpts:
        raise checkpoint.ResumeRefused(f"--resume: {run_dir}/checkpoints holds no checkpoint; start without --resume")
    broken = []
    for step, path in reversed(ckpts):
        try:
            state = checkpoint.load(path)
        except checkpoint.UNREADABLE as exc:  # a checkpoint damaged by a crash or a full disk
            broken.append(f"{path}: {exc}")
            continue
        diffs = checkpoint.config_differences(state["config"], cfg, families)
        if diffs:
            raise checkpoint.ResumeRefused(
                f"--resume refused: {path} was trained with different settings that change the result:\n  "
                + "\n  ".join(diffs) + "\nRestore them, or start a new run (another run.name).")
        state["step"], state["path"], state["skipped"] = step, path, broken
        return state
    raise checkpoint.ResumeRefused("--resume: no readable checkpoint:\n  " + "\n  ".join(broken))


def check_same_data(state: dict[str, Any], data_version: str) -> None:
    if state.get("dataset_version") not in (None, data_version):
        raise checkpoint.ResumeRefused(
            f"--resume refused: the dataset changed since {state['path']} (dataset version "
            f"{state['dataset_version'][:12]} then, {data_version[:12]} now): images, captions or repeats differ, so "
            "the run would not continue the same training. Restore the data, or start a new run (another run.name).")


def restore(state: dict[str, Any], family: Any, session: Any, data_version: str, total: int,
            out: Callable[[str], None]) -> int:
    """Load the checkpoint's adapter, optimizer and schedule into ``session``; returns its update."""
    for problem in state["skipped"]:
        out(f"warning: skipped a damaged checkpoint: {problem}")
    path = state["path"]
    check_same_data(state, data_version)
    if state.get("total_updates") not in (None, total):
        raise checkpoint.ResumeRefused(f"--resume refused: {path} belongs to a run of {state['total_updates']} "
                                       f"updates, this one would have {total}")
    if session.ema is not None:
        if state["ema_dir"] is None:
            raise checkpoint.ResumeRefused(f"--resume refused: {path} holds no moving average (adapter_ema/), but "
                                           "train.ema is on")
        loop.load_adapter(session.model, session.trainable, family, state["ema_dir"])
        session.ema.load(session.params)
    loop.load_adapter(session.model, session.trainable, family, state["adapter_dir"])
    if state["train_params"] is not None:  # the weights a schedule-free optimizer steps (the adapter: its average)
        with torch.no_grad():
            for i, p in enumerate(session.params):
                p.copy_(state["train_params"][str(i)])
    session.optimizer.load_state_dict(state["optimizer_state"])
    session.scheduler.load_state_dict(state["scheduler"])
    out(f"resuming from {path} (update {state['step']})")
    return state["step"]

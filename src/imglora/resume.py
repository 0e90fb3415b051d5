"""What ``--resume`` checks and restores, and what a new run refuses.

Everything that can refuse a run is checked before any model is loaded (GPU time costs): the
newest readable checkpoint whose settings match (a damaged one is reported and skipped), the
dataset's content, that a new run does not write into a folder holding an earlier one.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from . import checkpoint, lora
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
    """Settings that need bitsandbytes (and CUDA) fail before any model is loaded."""
    needs = [(cfg.train.optimizer == "adamw8bit", 'train.optimizer = "adamw8bit"', 'train.optimizer = "adamw"'),
             (cfg.memory.quantization == "nf4", 'memory.quantization = "nf4"', 'memory.quantization = "qint4"')]
    for wanted, setting, instead in needs:
        if not wanted:
            continue
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise ImgloraError(f"{setting} needs bitsandbytes: `pip install bitsandbytes` (CUDA only), or set "
                               f"{instead}") from None
        if not torch.cuda.is_available():
            raise ImgloraError(f"{setting} needs a CUDA GPU; on this machine set {instead}")


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
    lora.load_adapter_state(session.model, family.read_adapter(state["adapter_dir"]))
    session.optimizer.load_state_dict(state["optimizer_state"])
    session.scheduler.load_state_dict(state["scheduler"])
    out(f"resuming from {path} (update {state['step']})")
    return state["step"]

"""What ``--resume`` checks and restores, and what a new run refuses.

Everything that can refuse a run is checked before any model is loaded (GPU time costs): the
newest readable checkpoint whose settings match (a damaged one is reported and skipped), the
dataset's content, that a new run does not write into a folder holding an earlier one.

The run's length (``train.max_steps``, ``train.epochs``) may change on ``--resume``: a finished run
continues to the new length, an unfinished one stops at it. The schedule is then the new length's
from the checkpoint on (``continue_schedule``).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from . import checkpoint, step as loop, optimizers
from ..errors import ImgloraError

if TYPE_CHECKING:
    from ..config import Config


# Keys that set how long a run is: an earlier run, finished or not, may continue to a new length.
RUN_LENGTH = ("train.max_steps:", "train.epochs:")


def refuse_existing_run(run_dir: Path, command: str) -> None:
    """A new run never writes over an earlier one's checkpoints, log or adapter. When none of its
    checkpoints can be resumed, saying "continue it with --resume" would send the user into a
    failure: the message then says why, and how to start over."""
    ckpts = checkpoint.list_checkpoints(run_dir)
    if ckpts:
        damaged = []
        for _, path in reversed(ckpts):
            problem = checkpoint.damage(path)
            if problem is None:
                break
            damaged.append(problem)
        else:
            raise ImgloraError(f"{run_dir} already holds a run that cannot be resumed: {_all_damaged(damaged)}. "
                               + start_over(run_dir))
    if ckpts or (run_dir / "adapter").exists():
        newest = f" (newest checkpoint: update {ckpts[-1][0]})" if ckpts else ""
        raise ImgloraError(
            f"{run_dir} already holds a run{newest}. Continue it with `{command} --resume` (a finished run too: "
            "add --set train.max_steps=<more>), or start a new one under another name: --set run.name=<new name>")


def _all_damaged(problems: list[str]) -> str:
    if len(problems) == 1:
        return f"its only checkpoint is damaged ({problems[0]})"
    return f"all {len(problems)} of its checkpoints are damaged ({'; '.join(problems)})"


def start_over(run_dir: Path) -> str:
    adapter = (f"Its adapter ({run_dir / 'adapter'}) is intact and can still be exported. "
               if (run_dir / "adapter").is_dir() else "")
    return (f"{adapter}Start over under another name (--set run.name=<new name>), or remove this run first: "
            f"rm -rf {shlex.quote(str(run_dir))}")


class RunComplete(ImgloraError):
    """``--resume`` of a run that already reached its length: nothing to do, which is success
    (exit 0), so a scheduler that re-submits an ended job does not retry it forever."""

    exit_code = 0


def check_dependencies(cfg: "Config") -> None:
    """Packages the settings need, all named in one error with the one ``pip install`` that brings
    them, before any model is loaded; nf4 also needs CUDA, and memory.attention_kernel a kernel
    this machine has."""
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
    from ..util import devices  # memory.attention_kernel: the kernel named must run on this machine
    from . import step as loop

    loop.check_attention(cfg, devices.default_device())


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
        all_diffs = checkpoint.config_differences(state["config"], cfg, families)
        diffs = [d for d in all_diffs if not d.startswith(RUN_LENGTH)]
        lengths = [d for d in all_diffs if d.startswith(RUN_LENGTH)]
        if cfg.train.max_steps and cfg.train.max_steps < step:
            diffs.append(f"train.max_steps: {cfg.train.max_steps} now, but the checkpoint is at update {step}; to "
                         "continue the run, raise it above that")
        if diffs:
            raise checkpoint.ResumeRefused(
                f"--resume refused: {path} was trained with different settings that change the result:\n  "
                + "\n  ".join(diffs) + "\nRestore them, or start a new run (another run.name).")
        if _complete(run_dir, state, step, cfg, lengths):
            raise RunComplete(f"{run_dir} is already complete at {step} updates (adapter: {run_dir / 'adapter'}); "
                              "raise train.max_steps (or train.epochs) to train further, e.g. --resume --set "
                              f"train.max_steps={2 * step}")
        state["step"], state["path"], state["skipped"] = step, path, broken
        return state
    raise checkpoint.ResumeRefused(f"--resume: {run_dir} cannot be resumed: {_all_damaged(broken)}. "
                                   + start_over(run_dir))


def _complete(run_dir: Path, state: dict[str, Any], step: int, cfg: "Config", length_diffs: list[str]) -> bool:
    """The checkpoint ended its run, the run wrote its adapter, and the length asked for now is
    that run's. (An epoch count that changed is only known once the data is read: not here.)"""
    if state.get("total_updates") != step or not (run_dir / "adapter").is_dir():
        return False
    return cfg.train.max_steps == step if cfg.train.max_steps else not length_diffs


def check_same_data(state: dict[str, Any], data_version: str) -> None:
    if state.get("dataset_version") not in (None, data_version):
        raise checkpoint.ResumeRefused(
            f"--resume refused: the dataset changed since {state['path']} (dataset version "
            f"{state['dataset_version'][:12]} then, {data_version[:12]} now): images, captions or repeats differ, so "
            "the run would not continue the same training. Restore the data, or start a new run (another run.name).")


def check_processes(state: dict[str, Any], procs: int, command: str) -> None:
    """Resume with the process count the checkpoint was written with. The order of global batches
    and each sample's noise depend on the global batch (batch x processes), so another count would
    not continue the same run: refused, saying how to continue it."""
    before = state.get("processes") or 1
    if before != procs:
        raise checkpoint.ResumeRefused(
            f"--resume refused: {state['path']} was written by a run of {before} process{'es' if before > 1 else ''}, "
            f"this one has {procs}. The order of the (global) batches and each sample's noise follow the global batch, "
            f"so another process count would not continue the same run. Resume with {before} process"
            f"{'es' if before > 1 else ''} ({'imglora train PRESET --gpus ' + str(before) if before > 1 else 'a single process'}"
            f" ... --resume), or start a new run.")


def restore(state: dict[str, Any], family: Any, session: Any, data_version: str, total: int,
            out: Callable[[str], None]) -> int:
    """Load the checkpoint's adapter, optimizer and schedule into ``session``; returns its update."""
    for problem in state["skipped"]:
        out(f"warning: skipped a damaged checkpoint: {problem}")
    path = state["path"]
    if not state.get("verified", True):
        out(f"warning: {path} was written before checkpoints carried checksums ({checkpoint.MANIFEST}), so its "
            "files cannot be verified (only checked to be whole); resuming from it as it is")
    check_same_data(state, data_version)
    ran, now = state.get("quantization_ran"), session.memory.facts.get("quantization", {}).get("ran")
    if ran and now and ran != now:  # memory.quantization = "auto" chose another 4-bit kind on this machine
        raise checkpoint.ResumeRefused(
            f"--resume refused: {path} trained on a {ran} base, and this machine would run {now} "
            f"({session.memory.facts['quantization']['why']}); another 4-bit base would not continue the same "
            f"training. Resume on a machine where memory.quantization = \"auto\" gives {ran} (nf4: a CUDA GPU with "
            "bitsandbytes), or start a new run.")
    before = state.get("total_updates")
    if total < state["step"]:
        raise checkpoint.ResumeRefused(f"--resume refused: {path} is at update {state['step']}, beyond the "
                                       f"{total} updates this run would have; raise train.max_steps or train.epochs")
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
    if before not in (None, total):
        continue_schedule(session.optimizer, session.scheduler)
        out(f"resuming from {path} (update {state['step']}) with a new length: {before} -> {total} updates; the "
            f"learning-rate schedule is the one of a {total}-update run from here on")
    else:
        out(f"resuming from {path} (update {state['step']})")
    return state["step"]


def quantization_fact(session: Any) -> dict[str, Any]:
    """The 4-bit kind the base ran in (memory.quantization = "auto" decides it per machine), kept in
    each checkpoint so ``restore`` refuses a resume that would quantize otherwise."""
    ran = session.memory.facts.get("quantization", {}).get("ran")
    return {"quantization_ran": ran} if ran else {}


def continue_schedule(optimizer: Any, scheduler: Any) -> None:
    """After the run's length changed: the learning rate of the next update is the new schedule's
    at this update (as kohya sd-scripts continues when max_train_steps is raised on resume), not the
    one the optimizer saved under the old length. A constant schedule is unchanged, so a run
    extended that way equals one planned that long from the start, bit for bit."""
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports (the log's lr column)

"""``imglora train``: the run folder's lock and checks, the training loop, then (if asked) the
evaluation pass in a fresh process."""

from __future__ import annotations

import contextlib
import gc
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable


from ..util import atomic, devices, distributed
from ..training import runlock
from ..config import Config
from ..families import registry
from ..training.trainer import TrainResult, train as train_loop


def train(cfg: Config, *, resume: bool = False, command: str = "", out: Callable[[str], None] = print) -> TrainResult:
    """Train ``cfg``'s adapter into its run folder (see ``imglora.training``).

    ``command``: how this run was started, without ``--resume`` (``imglora train PRESET --set ...``);
    messages that say how to continue the run quote it. Default: ``imglora train <cfg.source>``.
    """
    for note in cfg.notes:
        out(f"note: {note}")
    command = command or f"imglora train {shlex.quote(cfg.source or '<preset>')}"
    # Checked before the run folder is touched: where the run and the cache will be written.
    atomic.check_writable(cfg.run.output_dir, "run.output_dir")
    atomic.check_writable(cfg.cache.dir, "cache.dir")
    main = distributed.rank_from_env() == 0  # several processes: the main one holds the run folder
    with runlock.hold(cfg.run_dir, command + (" --resume" if resume else "")) if main else contextlib.nullcontext():
        if main:
            for folder in (cfg.run_dir, cfg.run_dir / "checkpoints"):
                for line in atomic.recover(folder):  # only this process writes here now (the lock)
                    out(f"cleanup: {line}")
        finished = False
        try:
            result = train_loop(cfg, registry.get(cfg.model.family), registry, resume_run=resume, command=command,
                                out=out)
            finished = True
        finally:
            distributed.shutdown(finished)  # several processes: leave together, before exit-time teardown
    if cfg.train.eval_after and not result.interrupted and main:
        # Evaluate in a fresh process once this one has let go of the model, so sampling's memory
        # peak never stacks on training's (the train record holds training's peak only).
        result.eval_exit_code = run_eval_subprocess(result.run_dir, out)
    return result


def run_eval_subprocess(run_dir: Path, out: Callable[[str], None] = print) -> int:
    """``imglora eval RUN_DIR`` in a fresh process, after the caller has dropped its model. Returns
    the exit code."""
    gc.collect()
    devices.free(devices.default_device())
    out(f"train.eval_after: running `imglora eval {run_dir}` in a fresh process")
    code = subprocess.run([sys.executable, "-m", "imglora", "eval", str(run_dir)], check=False).returncode
    if code:
        out(f"evaluation failed (exit code {code}); the adapter is saved; retry with `imglora eval {run_dir}`")
    return code

"""Data parallelism across processes: ``imglora train --gpus N`` (or ``accelerate launch``).

Every process holds the whole model (with its own fp8 copy and its own swapped blocks), takes a
disjoint share of every global batch, and the LoRA gradients are summed across processes once per
update (each process's loss already carries its share's weight, so the sum is the global batch's
mean gradient). LoRA gradients are small (0.24 GiB for FLUX.1 at rank 16), so one flat all-reduce
per update is used instead of wrapping the model in DDP, whose wrapper would hide the family
model's attributes and fight the swap engine's placement. accelerate sets up the process group
(NCCL on GPUs, gloo on CPUs) and the device of each process; torch.distributed does the collectives.

``--gpus N`` starts the N processes itself (``launch``), as torch's launcher would set them up, so
that the launcher's signals reach each process once and a process that dies is named in one line
(torch's elastic agent adds a 40-line traceback to the survivors' own message, and exits at once on
SIGTERM while its workers train on).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch


def rank_from_env() -> int:
    """This process's rank as the launcher set it (0 when not launched as several)."""
    return int(os.environ.get("RANK", "0"))


def launched_processes() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def share(n: int, rank: int, world: int) -> slice:
    """The positions of a batch of ``n`` that process ``rank`` of ``world`` takes: contiguous, as
    even as can be (the first ``n % world`` take one more; a process may get none)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def sum_gradients(params: list[torch.nn.Parameter]) -> None:
    """Sum every parameter's gradient over the processes, in one flat all-reduce (a process that had
    no samples in this update contributes zeros)."""
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(g).to(g.dtype)
        offset += n


def max_all(values: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum over the processes (stop flags, the first non-finite update)."""
    import torch.distributed as dist

    out = values.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def sum_all(value: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    out = value.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another process died or stopped answering."""
    if isinstance(exc, getattr(torch.distributed, "DistBackendError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Timed out", "timed out", "Gloo", "NCCL",
        "ProcessGroup", "Broken pipe"))


@contextmanager
def peers_guard(procs: int, run: Any) -> Iterator[None]:
    """With several processes: a collective that fails because another process died becomes one
    message saying so, with the last checkpoint and how to continue."""
    try:
        yield
    except RuntimeError as exc:
        if procs < 2 or not is_peer_failure(exc):
            raise
        from ..errors import ImgloraError

        kept = run.last_checkpoint_path() if run is not None else None
        raise ImgloraError(
            f"another process of this {procs}-process run stopped answering ({str(exc).splitlines()[0][:200]}); "
            f"this one stops too. " + (f"The last checkpoint is {kept}: continue with the same command and "
                                       f"--resume." if kept else "No checkpoint had been written yet.")) from None


def shutdown(finished: bool) -> None:
    """Tear the process group down before the interpreter does. Left to the destructors that run at
    exit, gloo's threads can abort a process whose work is done ("terminate called without an
    active exception", SIGABRT: seen once in 4 CI runs, a 2-process run that had trained every
    update). ``finished``: every process got to the end, so each first waits for the others (the
    main one may still be writing the adapter); after a failure the group is only torn down."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if finished and dist.get_world_size() > 1:
            dist.barrier()
    except RuntimeError:  # a peer is gone: nothing left to wait for
        pass
    finally:
        dist.destroy_process_group()


def launch_command(n: int, argv: list[str], module_name: str = "imglora") -> list[str]:
    """The command that runs ``python -m <module_name> <argv>`` as ``n`` processes: accelerate's
    launcher on a CUDA machine; on a machine without CUDA, torch's own (accelerate's launcher runs
    several CPU processes only under MPI; inside each process accelerate sets up gloo the same)."""
    module = ["-m", module_name, *argv]
    if torch.cuda.is_available():
        return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu",
                "--num_processes", str(n), "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no", *module]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), *module]


GRACE_S = 30.0  # after a process died: how long the others get to stop on their own, then after SIGTERM


def launch(n: int, argv: list[str], module_name: str = "imglora", say=None) -> int:
    """Run ``python -m <module_name> <argv>`` as ``n`` processes of one process group on this machine
    and wait for them; returns the exit code (the first non-zero one in rank order, a process killed
    by a signal counting 128 + its number, as a shell reports it).

    Each process runs in a session of its own, so a terminal's Ctrl-C reaches only this launcher,
    which forwards it (and SIGTERM) once to each process: they stop at the same update, checkpoint
    and exit 130 / 143, and the launcher waits for them. (A process that got each Ctrl-C twice, from
    the terminal and from the launcher, would take the second as "stop without saving".) A process
    killed by a signal is named in one line; the others stop at their next exchange with it and say
    so, or are stopped after ``GRACE_S`` seconds (SIGTERM, then SIGKILL). A process that exits with a
    code ended on its own terms (the others agree to stop, or notice at their next exchange): the
    others get all the time they need, e.g. the main process to write the checkpoint."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    port, procs, forwarded = _free_port(), [], []

    def forward(signum: int, _frame) -> None:
        forwarded.append(signum)
        _signal_all(procs, signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(n):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
                   "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))  # n processes share the cores
            procs.append(subprocess.Popen([sys.executable, "-m", module_name, *argv], env=env,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
        _wait(procs, say)
    finally:
        _signal_all(procs, signal.SIGKILL)  # only if the launcher itself fails: none is left behind
        for sig, handler in old.items():
            signal.signal(sig, handler)
    codes = [128 - p.returncode if p.returncode < 0 else p.returncode for p in procs]
    return next((c for c in codes if c), 0)


def _wait(procs: list[subprocess.Popen], say) -> None:
    """Until every process has ended; the first killed by a signal starts the others' grace period."""
    first: tuple[int, float] | None = None  # (rank, when) of the first process killed by a signal
    stage = 0  # 1: SIGTERM sent to the rest, 2: SIGKILL sent
    while True:
        running = [p.poll() is None for p in procs]
        for rank, p in enumerate(procs):
            if first is None and p.returncode is not None and p.returncode < 0:
                first = (rank, time.monotonic())
                say(f"imglora: process {rank} of {len(procs)} (pid {p.pid}) was killed by "
                    f"{signal.Signals(-p.returncode).name}; the others stop at their next exchange with it")
        if not any(running):
            return
        if first is not None and time.monotonic() - first[1] > GRACE_S * (stage + 1) and stage < 2:
            stage += 1
            say(f"imglora: {'stopping' if stage == 1 else 'killing'} the processes still running "
                f"{GRACE_S * stage:.0f} s after process {first[0]} ended")
            _signal_all(procs, signal.SIGTERM if stage == 1 else signal.SIGKILL)
        time.sleep(0.05)


def _signal_all(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)  # its session's group: the process and anything it started
            except (ProcessLookupError, PermissionError):
                pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe(cmd: list[str]) -> str:
    return shlex.join(cmd)


def gather_info(accelerator: Any) -> dict[str, Any]:
    return {"processes": accelerator.num_processes, "backend": getattr(accelerator.state, "backend", None),
            "distributed_type": str(accelerator.distributed_type)}

"""One writer per run folder: ``imglora train`` holds ``<run>/.imglora.lock`` while it runs.

The lock is an ``flock`` on that file, so the kernel releases it when the process ends in any way,
SIGKILL included: a lock left by a dead process never blocks the next run. The file also holds
the owner's pid, host and command, so the refusal says who holds it; where ``flock`` is not
available (some network file systems) the pid is checked instead, and a lock whose process no
longer exists on this host is taken over.

A lock only guards while its file is in the folder: if the run folder is deleted (or the lock file
removed) mid-run, a second trainer can take a new lock there. ``check_held`` notices, and the run
stops rather than write into a folder that is no longer its own.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import ImgloraError

LOCK_NAME = ".imglora.lock"


class RunInUse(ImgloraError):
    exit_code = 4


class RunFolderGone(ImgloraError):
    exit_code = 4


_HELD: dict[str, tuple[int, Path]] = {}  # run folder (absolute) -> the open lock file and its path


def check_held(run_dir: str | os.PathLike, when: str) -> None:
    """Raise ``RunFolderGone`` if this process holds ``run_dir``'s lock but the lock file it holds
    is no longer the one in the folder (the folder deleted, or the lock file removed or replaced).
    ``when``: where the run is, for the message ("at update 12"). Folders not held here pass."""
    held = _HELD.get(os.path.abspath(run_dir))
    if held is None:
        return
    fd, path = held
    try:
        there, mine = os.stat(path), os.fstat(fd)
        if (there.st_ino, there.st_dev) == (mine.st_ino, mine.st_dev):
            return
    except OSError:  # no such file: the folder or the lock file was deleted
        pass
    raise RunFolderGone(
        f"the run folder {run_dir} was deleted, or its lock file {LOCK_NAME} removed, while this run was writing "
        f"there (noticed {when}); stopping without writing anything more, since another run may hold that folder "
        f"now. Train again into it (--resume if its checkpoints are still there), or into another with "
        f"--set run.name=<new name>")


def _describe(info: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("time", 0)))
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')} since {since}: {info.get('command', '?')}"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _alive(info: dict) -> bool:
    pid = info.get("pid")
    if not isinstance(pid, int) or info.get("host") != socket.gethostname():
        return isinstance(pid, int)  # another host's process: assume it is alive
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def hold(run_dir: str | os.PathLike, command: str | None = None) -> Iterator[Path]:
    """Hold the run folder's lock for the duration of the block, or raise ``RunInUse`` at once."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    info = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
            "command": command or " ".join(["imglora", *sys.argv[1:]])}
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    acquired = False
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunInUse(f"{run_dir} is in use by another imglora process ({_describe(_read(path))}); wait for it "
                           "to finish, or train into another folder with --set run.name=<new name>") from None
        except (ImportError, OSError):  # no flock here: fall back to the pid written in the file
            other = _read(path)
            if other and other.get("pid") != os.getpid() and _alive(other):
                raise RunInUse(f"{run_dir} is in use by another imglora process ({_describe(other)}); wait for it, "
                               f"or if it is gone delete {path}") from None
        acquired = True
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        _HELD[os.path.abspath(run_dir)] = (fd, path)
        yield path
    finally:
        if acquired:
            _HELD.pop(os.path.abspath(run_dir), None)
            try:
                os.ftruncate(fd, 0)  # no owner any more (the file stays: removing it would race a new owner)
            except OSError:
                pass
        os.close(fd)  # releases the flock

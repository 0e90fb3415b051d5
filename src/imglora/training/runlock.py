"""One writer per run folder: ``imglora train`` holds ``<run>/.imglora.lock`` while it runs.

The lock is an ``flock`` on that file, so the kernel releases it when the process ends in any way,
SIGKILL included: a lock left by a dead process never blocks the next run. The file also holds
the owner's pid, host, command and the process's start time (``create_time``, as psutil gives it;
locks written before it was recorded lack it and are still read), so the refusal says who holds it;
where ``flock`` is not available (some network file systems) the lock's process is checked instead,
and a lock whose process is surely not its run (ended, or its pid reused by another process:
``holder_gone``, by the rule ``process_matches`` gives the UI's Stop) is taken over with a note.

``process_matches(info)`` says whether a lock's process is, here and now, the imglora run the lock
describes (None) or why not (a reason): the check before anything signals the pid a lock names.

A lock only guards while its file is in the folder: if the run folder is deleted (or the lock file
removed) mid-run, a second trainer can take a new lock there. ``check_held`` notices, and the run
stops rather than write into a folder that is no longer its own.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import ImgloraError

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


def _create_time(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # psutil missing, or the process gone
        return None


def process_matches(info: dict) -> str | None:
    """None when the process a lock names is the live imglora run the lock describes, on this host;
    else the reason it is not (to be shown: signalling it would hit another process).

    Checked: the lock names this host (a lock written elsewhere, e.g. in a synced folder, names a pid
    of another machine); the pid is alive (not a zombie); the process started when the lock says
    (``create_time``; an older lock without it: not after the lock was written), so a pid reused by
    another process is not taken for the run; and its command line is ``imglora <command>`` as the
    lock records it (``python -m imglora train ...`` or the ``imglora`` script)."""
    return _why_not(info)[0]


def _why_not(info: dict) -> tuple[str | None, bool]:
    """``process_matches``' answer, and whether it is certain that the process is not the run (False
    where it may be: a lock without a host or of another host, a process that cannot be inspected)."""
    import psutil

    pid, host, here = info.get("pid"), info.get("host"), socket.gethostname()
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return f"the lock names no process id (pid {pid!r})", True
    if not host:
        return f"the lock names no host, so pid {pid} may be another machine's", False
    if host != here:
        return f"the lock was written on host {host!r}, not on this one ({here!r}): pid {pid} is a process there", False
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            status, started, argv = proc.status(), proc.create_time(), proc.cmdline()
    except psutil.ZombieProcess:
        return f"pid {pid} has exited (a zombie: a stale lock)", True
    except psutil.NoSuchProcess:
        return f"pid {pid} is not running (a stale lock: its process has ended)", True
    except psutil.AccessDenied:
        return f"pid {pid} cannot be inspected (access denied), so it cannot be told to be the run", False
    if status == psutil.STATUS_ZOMBIE:
        return f"pid {pid} has exited (a zombie: a stale lock)", True
    when = info.get("create_time")
    if isinstance(when, (int, float)) and not isinstance(when, bool):
        if abs(started - when) > 1.0:
            return (f"pid {pid} was started at {_clock(started)}, but the lock's process was started at "
                    f"{_clock(when)}: another process has that pid now"), True
    elif isinstance(info.get("time"), (int, float)) and started > info["time"] + 1.0:
        return (f"pid {pid} was started at {_clock(started)}, after the lock was written ({_clock(info['time'])}): "
                "another process has that pid now"), True
    try:
        words = shlex.split(str(info.get("command") or ""))
    except ValueError:
        words = str(info.get("command") or "").split()
    sub = words[1] if len(words) > 1 and Path(words[0]).name == "imglora" else None
    for i, arg in enumerate(argv):
        is_imglora = Path(arg).name in ("imglora", "imglora.exe") or (
            arg == "-m" and i + 1 < len(argv) and argv[i + 1] in ("imglora", "imglora.cli"))
        if is_imglora:
            rest = argv[i + (2 if arg == "-m" else 1):]
            if sub is None or (rest and rest[0] == sub):
                return None, True
            break
    return (f"pid {pid} runs {' '.join(argv)[:200]!r}, not the lock's {info.get('command')!r}: another process "
            "has that pid now"), True


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def holder_gone(info: dict) -> str | None:
    """Why the process a lock names is surely not running that lock's run (a stale lock to take over),
    by ``process_matches``' rule (a pid reused by another process is not the run), or None when it
    may be: a lock of another host, or a process that cannot be inspected, is never taken over."""
    reason, certain = _why_not(info)
    return reason if certain else None


@contextmanager
def hold(run_dir: str | os.PathLike, command: str | None = None) -> Iterator[Path]:
    """Hold the run folder's lock for the duration of the block, or raise ``RunInUse`` at once."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    info = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
            "command": command or " ".join(["imglora", *sys.argv[1:]]), "create_time": _create_time(os.getpid())}
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
            if other and other.get("pid") != os.getpid():
                stale = holder_gone(other)
                if stale is None:
                    where = ("" if other.get("host") == socket.gethostname() else
                             f"; it was written on host {other.get('host')!r}, so it cannot be checked from here")
                    raise RunInUse(f"{run_dir} is in use by another imglora process ({_describe(other)}{where}); wait "
                                   f"for it, or if it is gone delete {path}") from None
                print(f"note: {path}: a stale lock ({stale}); taken over", file=sys.stderr)
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

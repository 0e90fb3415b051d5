"""Atomic file writes: write to a temporary name in the same folder, fsync, then rename.

A crash at any point leaves either the old file or the new one, never a half-written file that a
later run would trust. Temporaries are named ``.<name>.<random>.tmp`` (folders replaced in place
are first moved aside as ``.<name>.old-<pid>``), so :func:`recover` can tidy what a killed process
left behind. Files and folders get the permissions the user's umask gives new files (mkstemp alone
would leave them private to the user, which a ComfyUI running as another user cannot read).

Every write error (a full disk, the file-size limit, a read-only folder, a path that is a file)
becomes one ``WriteError`` naming the destination and the fix, never a traceback from the writer.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..errors import ImgloraError


class WriteError(ImgloraError):
    """A file or folder could not be written; nothing half-written was left behind."""


def umask() -> int:
    """The process's umask, read without changing it where the platform allows."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting it, then put it back at once
    os.umask(mask)
    return mask


def explain(path: str | os.PathLike, exc: BaseException, what: str = "write") -> str:
    """One line for an I/O failure at ``path``: what happened and what to do."""
    path = Path(path)
    code = getattr(exc, "errno", None)
    text = str(exc)
    if code is None:  # safetensors wraps the OS error in its own message: "... (os error 28)"
        m = re.search(r"(?:code:\s*|os error )(\d+)", text)
        code = int(m.group(1)) if m else None
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        free = _free_bytes(path)
        room = f"{free / 2**20:.0f} MiB free there" if free is not None else ""
        if code == errno.EFBIG:  # a file too big for the process's limit (ulimit -f) or for the file system
            return _too_big(path, what, room)
        if code == errno.EDQUOT:
            return (f"cannot {what} {path}: the disk quota is exceeded ({room or 'quota reached'}); free some space "
                    "(old runs, the cache) or point the output elsewhere")
        plenty = free is not None and free > 2**30  # space left: out of inodes (many small files), say so
        inodes = "; with that much space left, the file system may be out of inodes (`df -i`)" if plenty else ""
        return (f"cannot {what} {path}: the disk is full{f' ({room})' if room else ''}{inodes}; free some space "
                "(old runs, the cache) or point the output elsewhere")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot {what} {path}: permission denied (read-only folder or file system); choose a writable folder"
    if code in (errno.ENOTDIR, errno.EEXIST):
        return f"cannot {what} {path}: a file stands where a folder is needed; move it away or choose another folder"
    reason = getattr(exc, "strerror", None) or text
    return f"cannot {what} {path}: {reason}"


def _too_big(path: Path, what: str, room: str) -> str:
    """EFBIG: the file-size limit (``ulimit -f``; CPython ignores SIGXFSZ, so the write fails with
    EFBIG instead of killing the process) or, without one, the file system's largest file."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    room = f"; {room}" if room else ""
    if soft != resource.RLIM_INFINITY:
        return (f"cannot {what} {path}: the file-size limit was reached: `ulimit -f` is {soft // 1024} (KiB, so "
                f"{_size(soft)} per file){room}. Raise it (`ulimit -f unlimited` in the shell or job script that "
                "starts imglora) and run again")
    return (f"cannot {what} {path}: the file is larger than this file system allows (e.g. 4 GiB on FAT32){room}; "
            "point the output to another file system")


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return None


def _write_errors() -> tuple[type[BaseException], ...]:
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - safetensors is a dependency
        return (OSError,)
    return (OSError, SafetensorError)


def check_writable(folder: str | os.PathLike, setting: str) -> Path:
    """Create ``folder`` if needed and prove a file can be written there, before any slow work.

    ``setting`` names the preset key (``run.output_dir``), so the message says what to change.
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".imglora-write-test.", suffix=".tmp", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise WriteError(f"{setting}: {explain(folder, exc, 'write into')} (--set {setting}=...)") from None
    return folder


def _chmod_default(path: Path, directory: bool) -> None:
    os.chmod(path, (0o777 if directory else 0o666) & ~umask())


@contextmanager
def atomic_path(dest: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``dest``; on success it is renamed onto ``dest``."""
    dest = Path(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=suffix + ".tmp", dir=dest.parent)
        os.close(fd)
    except OSError as exc:
        raise WriteError(explain(dest, exc)) from None
    tmp_path = Path(tmp)
    try:
        try:
            yield tmp_path
            with open(tmp_path, "rb+") as fh:
                os.fsync(fh.fileno())
            _chmod_default(tmp_path, directory=False)
            os.replace(tmp_path, dest)
        except _write_errors() as exc:
            raise WriteError(explain(dest, exc)) from None
        _fsync_dir(dest.parent)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_bytes(dest: str | os.PathLike, data: bytes) -> None:
    with atomic_path(dest) as tmp:
        tmp.write_bytes(data)


def write_text(dest: str | os.PathLike, text: str) -> None:
    write_bytes(dest, text.encode("utf-8"))


def write_json(dest: str | os.PathLike, obj: Any) -> None:
    write_text(dest, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def save_safetensors(dest: str | os.PathLike, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    with atomic_path(dest, suffix=".safetensors") as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


@contextmanager
def atomic_dir(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder beside ``dest``; on success it replaces ``dest`` in one rename.

    If ``dest`` exists it is moved aside first and removed only after the new folder is in place
    (:func:`recover` puts it back if the process dies in between).
    """
    dest = Path(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    except OSError as exc:
        raise WriteError(explain(dest, exc)) from None
    try:
        try:
            yield tmp
            _fsync_tree(tmp)  # the files' contents reach the disk before the rename makes them visible
            for p in (tmp, *tmp.rglob("*")):
                _chmod_default(p, directory=p.is_dir())
            old = None
            if dest.exists():
                old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
                os.replace(dest, old)
            os.replace(tmp, dest)
        except _write_errors() as exc:
            raise WriteError(explain(dest, exc)) from None
        _fsync_dir(dest.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


_TMP = re.compile(r"^\.(?P<name>.+)\.[^.]+\.tmp$")
_OLD = re.compile(r"^\.(?P<name>.+)\.old-\d+$")


def recover(folder: str | os.PathLike) -> list[str]:
    """Tidy what a killed writer left in ``folder``: temporaries are removed, and a folder moved
    aside (``.<name>.old-<pid>``) whose replacement never arrived is put back. Only call it while
    no other process writes there (the run lock). Returns what was done, one line each."""
    folder = Path(folder)
    done: list[str] = []
    if not folder.is_dir():
        return done
    for entry in sorted(folder.iterdir()):
        old = _OLD.match(entry.name)
        if old:
            original = folder / old["name"]
            if original.exists():
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
                done.append(f"removed {entry} (an earlier copy of {original.name})")
            else:
                os.replace(entry, original)
                done.append(f"restored {original} (its replacement was never written)")
        elif _TMP.match(entry.name) or entry.name.startswith(".imglora-write-test."):
            size = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file()) if entry.is_dir() else \
                entry.stat().st_size
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
            done.append(f"removed {entry} ({size / 2**20:.1f} MiB, left by an interrupted write)")
    return done


def _fsync_tree(folder: Path) -> None:
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
    for d in sorted({p for p in folder.rglob("*") if p.is_dir()} | {folder}):
        _fsync_dir(d)


def _fsync_dir(folder: Path) -> None:
    """Make a rename or a new file in ``folder`` durable (POSIX: fsync the directory)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # e.g. a platform without directory file descriptors
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories; the rename is then as durable as they allow
    finally:
        os.close(fd)

"""Atomic writes: the user's umask applies, write failures are one named error, leftovers are tidied."""

from __future__ import annotations

import os
import resource
import signal
import stat
from pathlib import Path

import pytest
import torch

from imglora.util import atomic


@pytest.fixture()
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_files_and_folders_get_the_umask_permissions_not_private_ones(tmp_path: Path, umask_022) -> None:
    atomic.write_text(tmp_path / "a.json", "{}")
    atomic.save_safetensors(tmp_path / "t.safetensors", {"x": torch.ones(2)})
    with atomic.atomic_dir(tmp_path / "ckpt") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "f.txt").write_text("x")
    assert mode(tmp_path / "a.json") == 0o644 and mode(tmp_path / "t.safetensors") == 0o644
    assert mode(tmp_path / "ckpt") == 0o755 and mode(tmp_path / "ckpt" / "sub") == 0o755
    assert mode(tmp_path / "ckpt" / "sub" / "f.txt") == 0o644
    os.umask(0o077)
    atomic.write_text(tmp_path / "private.json", "{}")
    assert mode(tmp_path / "private.json") == 0o600


def test_a_file_in_the_way_is_one_named_error(tmp_path: Path) -> None:
    (tmp_path / "runs").write_text("not a folder")
    with pytest.raises(atomic.WriteError, match=r"runs.*a file stands where a folder is needed"):
        atomic.write_json(tmp_path / "runs" / "x" / "record.json", {})
    with pytest.raises(atomic.WriteError, match=r"run.output_dir: cannot write into .*runs.*--set run.output_dir="):
        atomic.check_writable(tmp_path / "runs", "run.output_dir")


def test_read_only_folder_is_named_with_the_setting(tmp_path: Path, monkeypatch) -> None:
    import errno
    import tempfile

    real = tempfile.mkstemp

    def read_only(*a, dir=None, **k):  # root ignores permission bits: simulate the file system's answer
        if dir is not None and Path(dir).is_relative_to(tmp_path / "ro"):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*a, dir=dir, **k)

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(atomic.WriteError, match=r"cache.dir: cannot write into .*ro.*read-only"):
        atomic.check_writable(tmp_path / "ro" / "cache", "cache.dir")


def test_a_full_disk_fails_cleanly_and_leaves_nothing_half_written(tmp_path: Path) -> None:
    # A real write failure: the file-size limit makes the kernel refuse the write (EFBIG), as a full disk does.
    atomic.save_safetensors(tmp_path / "good.safetensors", {"x": torch.ones(4)})
    good = (tmp_path / "good.safetensors").read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        with pytest.raises(atomic.WriteError, match=r"good.safetensors: the file-size limit was reached: `ulimit -f` is 64"):
            atomic.save_safetensors(tmp_path / "good.safetensors", {"x": torch.ones(100_000)})
        with pytest.raises(atomic.WriteError, match=r"ckpt: the file-size limit was reached"):
            with atomic.atomic_dir(tmp_path / "ckpt") as tmp:
                (tmp / "big.bin").write_bytes(b"\0" * 200_000)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert (tmp_path / "good.safetensors").read_bytes() == good  # the earlier file is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.safetensors"]  # no temporaries left


LIMITED_WRITE = """
import resource, sys, torch
from imglora.util import atomic
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    atomic.save_safetensors(sys.argv[1], {"x": torch.ones(1 << 19)})  # 2 MiB
except atomic.WriteError as exc:
    print(exc)
"""


def test_the_file_size_limit_is_named_when_the_disk_has_room(tmp_path: Path) -> None:
    # A process of its own under `ulimit -f 1024` (1 MiB): CPython ignores SIGXFSZ, so the write fails with EFBIG.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", LIMITED_WRITE, str(tmp_path / "big.safetensors")],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "big.safetensors: the file-size limit was reached: `ulimit -f` is 1024 (KiB, so 1 MiB per file)" in out
    assert "MiB free there" in out and "`ulimit -f unlimited`" in out
    assert "disk is full" not in out and "free some space" not in out
    assert not list(tmp_path.iterdir())  # the temporary is gone


def test_a_full_disk_and_a_quota_are_told_apart(tmp_path: Path) -> None:
    import errno

    full = atomic.explain(tmp_path / "x", OSError(errno.ENOSPC, "No space left on device"))
    assert full.startswith(f"cannot write {tmp_path / 'x'}: the disk is full (") and "free some space" in full
    quota = atomic.explain(tmp_path / "x", OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert "the disk quota is exceeded" in quota
    # safetensors' own error text: EFBIG with no file-size limit is the file system's largest file
    rust = atomic.explain(tmp_path / "x", Exception("I/O error: File too large (os error 27)"))
    limited = resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY
    assert ("the file-size limit was reached" if limited else "larger than this file system allows") in rust


def test_recover_removes_temporaries_and_puts_back_a_folder_moved_aside(tmp_path: Path) -> None:
    (tmp_path / ".step-000004.abcd.tmp").mkdir()
    (tmp_path / ".step-000004.abcd.tmp" / "optimizer.safetensors").write_bytes(b"\0" * 3000)
    (tmp_path / ".log.jsonl.x1y2.tmp").write_text("half")
    (tmp_path / ".adapter.old-4242").mkdir()  # killed between moving the old adapter aside and the rename
    (tmp_path / ".adapter.old-4242" / "w.safetensors").write_text("old adapter")
    (tmp_path / "step-000002").mkdir()
    (tmp_path / ".step-000002.old-99").mkdir()  # its replacement did arrive: the old copy goes
    done = atomic.recover(tmp_path)
    assert len(done) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "step-000002"]
    assert (tmp_path / "adapter" / "w.safetensors").read_text() == "old adapter"

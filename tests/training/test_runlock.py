"""One writer per run folder: a second trainer refuses at once; a lock dies with its process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from imglora.training import runlock

HOLDER = """
import sys, time
from imglora.training import runlock
with runlock.hold(sys.argv[1], "imglora train presets/x.toml --set run.name=a"):
    print("held", flush=True)
    time.sleep(120)
"""


def start_holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_holder_is_refused_naming_the_first_and_sigkill_releases(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    holder = start_holder(run_dir)
    try:
        with pytest.raises(runlock.RunInUse) as exc:
            with runlock.hold(run_dir):
                pass
        msg = str(exc.value)
        assert f"pid {holder.pid}" in msg and "imglora train presets/x.toml --set run.name=a" in msg
        assert "--set run.name=" in msg and str(run_dir) in msg
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The kernel dropped the dead process's lock: the next run takes it, no manual clean-up.
    with runlock.hold(run_dir, "imglora train b") as path:
        assert f'"pid": {os.getpid()}' in path.read_text()
    assert path.read_text() == ""  # released: no owner recorded


def test_lock_is_released_when_the_holder_raises(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with runlock.hold(tmp_path):
            raise RuntimeError("boom")
    with runlock.hold(tmp_path):
        pass


def test_without_flock_only_the_live_run_a_lock_describes_keeps_it(tmp_path: Path, monkeypatch, capsys) -> None:
    """Where flock is missing the lock's process is checked as the UI's Stop checks it: a dead pid, or a
    live pid that another program now has, is a stale lock taken over with a note; the live imglora
    run the lock describes, or a lock written on another host, is refused."""
    import fcntl
    import json
    import socket

    def no_flock(*a, **k):
        raise OSError(38, "Function not implemented")  # as on a file system without flock

    monkeypatch.setattr(fcntl, "flock", no_flock)
    run = tmp_path / "run"
    run.mkdir()
    lock = run / runlock.LOCK_NAME
    here = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"pid": dead.pid, "host": here, "time": time.time(), "command": "imglora train x"}))
    with runlock.hold(run):
        pass
    assert f"a stale lock (pid {dead.pid} is not running" in capsys.readouterr().err
    script = tmp_path / "bin" / "imglora"  # a live `imglora train x.toml` holding another folder's lock
    script.parent.mkdir()
    script.write_text(IMGLORA_HOLDER)
    holder = subprocess.Popen([sys.executable, str(script), "train", "x.toml", str(tmp_path / "other")],
                              stdout=subprocess.PIPE, text=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert holder.stdout.readline().strip() == "held"
        info = json.loads((tmp_path / "other" / runlock.LOCK_NAME).read_text())
        lock.write_text(json.dumps(info))
        with pytest.raises(runlock.RunInUse, match=f"pid {holder.pid}.*imglora train x.toml"):
            with runlock.hold(run):
                pass
        lock.write_text(json.dumps(info | {"host": "elsewhere"}))
        with pytest.raises(runlock.RunInUse, match="written on host 'elsewhere', so it cannot be checked from here"):
            with runlock.hold(run):
                pass
        # a pid reused by another program (a sleeper, not imglora): the lock is stale
        import psutil

        lock.write_text(json.dumps({"pid": sleeper.pid, "host": here, "time": time.time(), "command": "imglora train x",
                                    "create_time": psutil.Process(sleeper.pid).create_time()}))
        with runlock.hold(run):
            assert json.loads(lock.read_text())["pid"] == os.getpid()
        assert f"a stale lock (pid {sleeper.pid} runs " in capsys.readouterr().err
        assert sleeper.poll() is None  # nothing was signalled
    finally:
        for p in (holder, sleeper):
            p.kill()
            p.wait()


def test_a_deleted_run_folder_or_a_replaced_lock_file_is_noticed(tmp_path: Path) -> None:
    import shutil

    from imglora.training.runlock import RunFolderGone, check_held

    run = tmp_path / "run"
    with runlock.hold(run, "imglora train x"):
        check_held(run, "at update 1")  # still its own
        shutil.rmtree(run)
        with pytest.raises(RunFolderGone, match=rf"the run folder {re.escape(str(run))} was deleted, or its lock file "
                                                r"\.imglora\.lock removed, while this run was writing there \(noticed "
                                                r"at update 7\); stopping without writing anything more"):
            check_held(run, "at update 7")
    check_held(run, "later")  # no longer held by this process: nothing to check
    with runlock.hold(run, "imglora train x") as lock:
        lock.unlink()
        lock.write_text("{}")  # another process's new lock file in its place
        with pytest.raises(RunFolderGone):
            check_held(run, "at update 2")


IMGLORA_HOLDER = """
import sys, time
from imglora.training import runlock
with runlock.hold(sys.argv[3], "imglora " + sys.argv[1] + " " + sys.argv[2]):
    print("held", flush=True)
    time.sleep(120)
"""


def test_process_matches_only_the_live_imglora_run_the_lock_describes(tmp_path: Path) -> None:
    """Before anything signals the pid a lock names (the UI's Stop, a takeover of a stale lock): that
    pid must be, on this host, the imglora process the lock describes; else the reason it is not."""
    import json
    import socket

    import psutil

    script = tmp_path / "bin" / "imglora"  # a command line `... imglora train x.toml ...`, as the CLI script
    script.parent.mkdir()
    script.write_text(IMGLORA_HOLDER)
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, str(script), "train", "x.toml", str(run)], stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert holder.stdout.readline().strip() == "held"
        info = json.loads((run / runlock.LOCK_NAME).read_text())
        assert info["host"] == socket.gethostname()  # what a lock records now: its process's start time too
        assert info["create_time"] == psutil.Process(holder.pid).create_time()
        assert runlock.process_matches(info) is None
        old = {k: v for k, v in info.items() if k != "create_time"}  # a lock written before create_time was
        assert runlock.process_matches(old) is None
        here = socket.gethostname()
        started = psutil.Process(other.pid).create_time()
        for lock, why in [
            (info | {"host": "elsewhere"}, f"the lock was written on host 'elsewhere', not on this one ({here!r})"),
            ({k: v for k, v in info.items() if k != "host"}, f"the lock names no host, so pid {holder.pid} may be"),
            (info | {"pid": "12"}, "the lock names no process id (pid '12')"),
            (info | {"create_time": info["create_time"] - 30}, "another process has that pid now"),
            (old | {"time": info["create_time"] - 30}, "after the lock was written"),
            (info | {"command": "imglora eval runs/a"}, "not the lock's 'imglora eval runs/a'"),
            (info | {"pid": other.pid, "create_time": started}, f"pid {other.pid} runs "),  # not imglora
        ]:
            got = runlock.process_matches(lock)
            assert got is not None and why in got, (lock, got)
        holder.kill()
        holder.wait()
        assert runlock.process_matches(info) == f"pid {holder.pid} is not running (a stale lock: its process has ended)"
        zombie = subprocess.Popen([sys.executable, "-c", "pass"])
        while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.02)
        got = runlock.process_matches({"pid": zombie.pid, "host": here, "time": time.time(), "command": "imglora train"})
        assert got == f"pid {zombie.pid} has exited (a zombie: a stale lock)"
        zombie.wait()
    finally:
        for p in (holder, other):
            p.kill()
            p.wait()

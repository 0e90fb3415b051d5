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

from imglora import runlock

HOLDER = """
import sys, time
from imglora import runlock
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


def test_without_flock_a_dead_pid_is_taken_over_and_a_live_one_refused(tmp_path: Path, monkeypatch) -> None:
    import fcntl
    import json
    import socket

    def no_flock(*a, **k):
        raise OSError(38, "Function not implemented")  # as on a file system without flock

    monkeypatch.setattr(fcntl, "flock", no_flock)
    lock = tmp_path / runlock.LOCK_NAME
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "time": time.time(), "command": "x"}))
    with runlock.hold(tmp_path):
        pass
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname(), "time": time.time(),
                                    "command": "imglora train other"}))
        with pytest.raises(runlock.RunInUse, match=f"pid {sleeper.pid}.*imglora train other"):
            with runlock.hold(tmp_path):
                pass
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_deleted_run_folder_or_a_replaced_lock_file_is_noticed(tmp_path: Path) -> None:
    import shutil

    from imglora.runlock import RunFolderGone, check_held

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

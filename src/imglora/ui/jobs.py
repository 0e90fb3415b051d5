"""The CLI commands the UI starts: each a process in its own session, outliving the page and the
server, its output in a log file the page tails."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from . import run_folders as rv
from .guard import Refused


def as_sets(overrides: list[Any]) -> list[str]:
    """``KEY=VALUE`` overrides as the CLI's ``--set KEY=VALUE`` arguments."""
    return [x for o in overrides for x in ("--set", str(o))]


class Launcher:
    """CLI commands started as processes of their own session (they outlive the page and the server);
    their output goes to a log file the page tails. Finished ones are reaped on every request (no
    zombies), and a run folder has at most one start under way (``lock`` around check and start)."""

    def __init__(self, root: Path):
        self.root = root
        self.jobs: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()

    def start(self, kind: str, argv: list[str], log: Path, cwd: Path | None = None,
              run: Path | None = None) -> dict[str, Any]:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "imglora", *argv], cwd=cwd or self.root, stdout=fh,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        job_id = secrets.token_hex(4)
        self.jobs[job_id] = {"id": job_id, "kind": kind, "argv": argv, "pid": proc.pid, "log": str(log),
                             "started": time.time(), "run_dir": str(run) if run else None, "proc": proc}
        return self.view(job_id)

    def reap(self) -> None:
        """Collect every finished job's exit status (so none stays a zombie)."""
        for job in list(self.jobs.values()):
            job["proc"].poll()

    def active_for(self, run: Path) -> dict[str, Any] | None:
        """A job started for ``run`` that is still running (a start not yet holding the run's lock)."""
        for job in self.jobs.values():
            if job.get("run_dir") == str(run) and job["proc"].poll() is None:
                return job
        return None

    def view(self, job_id: str) -> dict[str, Any]:
        job = self.jobs.get(job_id)
        if job is None:
            raise Refused(404, f"no job {job_id}")
        rc = job["proc"].poll()
        return {k: v for k, v in job.items() if k != "proc"} | {
            "running": rc is None, "returncode": rc, "tail": rv.tail(Path(job["log"]), 30)}

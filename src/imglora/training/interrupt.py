"""Stopping a run cleanly: SIGTERM or Ctrl-C ask the loop to finish the current update, write a
checkpoint and exit (resumable); a second Ctrl-C a moment later abandons the update under way; a
checkpoint being written is never abandoned."""

from __future__ import annotations

import signal
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator


class Abandoned(KeyboardInterrupt):
    """A second Ctrl-C while an update runs: stop at once, without saving that update."""


@contextmanager
def saving(stop: "StopFlag | None") -> Iterator[None]:
    """A checkpoint being written: a Ctrl-C meanwhile is noted, never abandons it."""
    if stop is None:
        yield
        return
    before, stop.saving = stop.saving, True
    try:
        yield
    finally:
        stop.saving = before


class StopFlag:
    """SIGTERM / Ctrl-C ask the loop to finish the current update, checkpoint and exit.

    Ctrl-C is often pressed several times in a row; those within ``REPEAT_S`` of the first count as
    the same one. A later one while an update still runs stops at once without saving it (raises
    ``Abandoned``: the last checkpoint is kept), which the first Ctrl-C's message says. A Ctrl-C
    while a checkpoint is written never abandons it."""

    REPEAT_S = 1.0

    def __init__(self, last_checkpoint: Callable[[], str | None] = lambda: None, speak: bool = True) -> None:
        self.speak = speak  # several processes: only the main one says what it does
        self.signal: int | None = None
        self.saving = False
        self.last_checkpoint = last_checkpoint
        self._at = 0.0
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "StopFlag":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signal is None:
            self.signal, self._at = signum, time.monotonic()
            kept = self.last_checkpoint()
            again = (" Press Ctrl-C again, a second or more from now, to stop at once without saving this update"
                     f" ({f'the last checkpoint, {kept}, is kept' if kept else 'no checkpoint has been written yet'})."
                     if signum == signal.SIGINT else "")
            self._say(f"\n{name} received: finishing this update, then saving a checkpoint.{again}")
        elif self.saving:
            self._say(f"{name} received again: the checkpoint is being written and is not abandoned; it ends in a "
                      "moment")
        elif signum == signal.SIGINT and time.monotonic() - self._at >= self.REPEAT_S:
            raise Abandoned()
        else:
            self._say(f"{name} received again: already stopping after this update, then saving a checkpoint")

    def _say(self, line: str) -> None:
        if self.speak:
            print(line, file=sys.stderr, flush=True)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

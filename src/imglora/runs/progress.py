"""Progress for long work: a live bar on a terminal, plain timestamped lines in a file or pipe.

``nohup imglora train ... > log`` or ``| tee`` must get readable lines, not ``\\r`` redraws that
collapse into one garbled line; a person at a terminal gets tqdm's bar (rate and ETA included).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

PLAIN_EVERY_SECONDS = 30.0  # a plain line at least this often, besides every 10 % and the end


def is_tty(stream: TextIO | None = None) -> bool:
    stream = stream or sys.stdout
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def stamp(line: str, stream: TextIO | None = None) -> str:
    """``line`` with the wall-clock time in front when it goes to a file or pipe (logs are read later)."""
    return line if is_tty(stream) else f"[{time.strftime('%H:%M:%S')}] {line}"


def stamped(echo: Callable[[str], Any], stream: TextIO | None = None) -> Callable[[str], None]:
    """An ``out`` function that timestamps every line it prints when not on a terminal."""
    return lambda line: echo(stamp(line, stream))


class Progress:
    """``with Progress(n, "encoding latents") as p: ... p.update()``."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, enabled: bool = True):
        self.total, self.label, self.n = total, label, 0
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0
        self._bar: Any = None
        self._t0 = self._last = time.perf_counter()
        self._next_pct = 10
        if self.enabled and is_tty(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=label, file=self.stream, leave=True, dynamic_ncols=True, unit="it")

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.perf_counter()
        pct = 100 * self.n // self.total
        if self.n >= self.total or pct >= self._next_pct or now - self._last >= PLAIN_EVERY_SECONDS:
            self._next_pct = (pct // 10 + 1) * 10
            self._last = now
            elapsed = now - self._t0
            eta = elapsed / self.n * (self.total - self.n) if self.n else 0.0
            print(stamp(f"{self.label}: {self.n}/{self.total} ({elapsed:.0f} s, ETA {eta:.0f} s)", self.stream),
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

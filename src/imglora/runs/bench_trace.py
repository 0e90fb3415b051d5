"""bench-swap's worker progress on stderr, and what the parent reads from the log of a worker that
died without a result: where it was (the last progress line) and what went wrong (the exception's
line, not the C++ frames an abort prints after it)."""

from __future__ import annotations

import re
import sys

TRACE = "bench-worker: "  # the worker's progress lines on stderr (the stage of a worker that dies)


def trace(what: str) -> None:
    print(TRACE + what, file=sys.stderr, flush=True)


def last_trace(log: str) -> str:
    """Where a worker that left no result was: its last progress line (``bench-worker: ...``)."""
    marks = [line[len(TRACE):].strip() for line in log.splitlines() if line.startswith(TRACE)]
    return marks[-1] if marks else "unknown"


def error_lines(lines: list[str]) -> str:
    """The lines that say what went wrong: the last exception's message (not the C++ frames an abort
    prints after it), else the last five lines."""
    msgs = [i for i, line in enumerate(lines) if re.match(r"^[\w.]*(Error|Exception)\b.*?:", line)
            or line.startswith("terminate called")]
    if msgs:
        first = msgs[0]
        return "\n".join(lines[first:first + 3] if len(msgs) == 1 else [lines[i] for i in msgs[:3]])
    return "\n".join(lines[-5:])

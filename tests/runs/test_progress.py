"""Progress written to a file or pipe: plain, timestamped lines, never carriage-return redraws."""

from __future__ import annotations

import io
import re

from imglora.runs.progress import Progress, stamp, stamped


def test_plain_lines_with_times_when_not_a_terminal() -> None:
    buf = io.StringIO()
    with Progress(20, "encoding latents", stream=buf) as p:
        for _ in range(20):
            p.update()
    text = buf.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 10  # every 10 %, not every item
    assert all(re.match(r"^\[\d\d:\d\d:\d\d\] encoding latents: \d+/20 \(\d+ s, ETA \d+ s\)$", x) for x in lines)
    assert lines[-1].startswith("[") and "20/20" in lines[-1]


def test_stamped_output_and_disabled_progress() -> None:
    printed: list[str] = []
    out = stamped(printed.append, io.StringIO())
    out("loss 0.5")
    assert re.match(r"^\[\d\d:\d\d:\d\d\] loss 0.5$", printed[0])
    buf = io.StringIO()
    with Progress(5, "x", stream=buf, enabled=False) as p:
        p.update(5)
    assert buf.getvalue() == "" and stamp("y", buf).endswith("] y")

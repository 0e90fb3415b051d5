"""A run's log: ``log.jsonl`` rows, the progress line, the loss-curve PNG (trackers: ``trackers``)."""

from __future__ import annotations

import json
import statistics
import sys
from collections import deque
from pathlib import Path
from typing import Any

import torch

from ..util import atomic
from . import telemetry
from ..util.devices import is_cuda


def append(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


def read(path: Path, upto: int) -> list[dict[str, Any]]:
    """Rows up to the resumed update; later rows (from the interrupted attempt) are dropped."""
    if not path.exists():
        return []
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:  # e.g. the last line of a run killed mid-write
            print(f"warning: {path}:{n} is not a JSON line; dropped", file=sys.stderr)
            continue
        if row is not None and row.get("step", 0) <= upto:
            rows.append(row)
    atomic.write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def progress_line(step: int, total: int, row: dict[str, Any], times: list[float], device: torch.device,
                  currency: str = "USD") -> str:
    recent = times[-20:]
    per = sorted(recent)[len(recent) // 2] if recent else row["sec_per_update"]
    eta = telemetry.fmt_duration(per * (total - step))
    width = 20
    filled = int(width * step / total)
    mem = (f" | peak {telemetry.gib(row['peak_allocated'])} alloc, {telemetry.gib(row['peak_reserved'])} reserved"
           if is_cuda(device) else "")
    cost = f" | {row['cost']:.2f} {currency} so far" if "cost" in row else ""
    loss = f"loss {row['loss']:.4f}" if "loss" in row else "loss - (every update skipped)"
    skipped = f" ({row['skipped_updates']} skipped)" if row.get("skipped_updates") else ""
    return (f"[{'#' * filled}{'.' * (width - filled)}] {step}/{total} | {loss}{skipped} | "
            f"{row['sec_per_update']:.2f} s/update | ETA {eta}{mem} | RSS {row['rss'] / 2**30:.2f} GiB{cost}")


class DivergenceWatch:
    """Says when the loss is running away (a learning rate far too high, no gradient clipping):
    the running median of the last ``WINDOW`` logged losses exceeds ``FACTOR`` times its lowest
    value so far, a lowest counted only once ``MIN_LOGS`` losses were in the window.

    A logged loss is already a mean over the updates since the previous log, but a diffusion loss
    still varies several-fold with the timesteps drawn; a median ignores a single spike, and a ten
    times rise of the median is not noise (a healthy run's median moves well within 2x)."""

    WINDOW, MIN_LOGS, FACTOR = 5, 3, 10.0
    RULE = (f"running median of the last {WINDOW} logged losses above {FACTOR:g}x its lowest value "
            f"(counted from {MIN_LOGS} logs)")

    def __init__(self) -> None:
        self.window: deque[float] = deque(maxlen=self.WINDOW)
        self.lowest: tuple[int, float] | None = None  # (update, median)
        self.first: dict[str, Any] | None = None  # the first update at which the rule held

    def add(self, step: int, loss: float) -> bool:
        """Take the loss logged at ``step``; whether the run is diverging there."""
        self.window.append(loss)
        median = statistics.median(self.window)
        if len(self.window) >= self.MIN_LOGS and (self.lowest is None or median < self.lowest[1]):
            self.lowest = (step, median)
        diverging = self.lowest is not None and median > self.FACTOR * self.lowest[1] > 0
        if diverging and self.first is None:
            self.first = {"step": step, "median_loss": round(median, 6), "lowest_median_loss": round(self.lowest[1], 6),
                          "lowest_at": self.lowest[0], "rule": self.RULE}
        return diverging

    def warning(self) -> str:
        f = self.first or {}
        return (f"warning: the loss is diverging: at update {f['step']} its running median over the last "
                f"{self.WINDOW} logs is {f['median_loss']:.4g}, more than {self.FACTOR:g}x its lowest "
                f"({f['lowest_median_loss']:.4g} at update {f['lowest_at']}). Likely a learning rate too high or "
                "no gradient clipping (train.max_grad_norm); training goes on, but this adapter is probably "
                "useless: stop with Ctrl-C (a checkpoint is saved) and train again with a lower "
                "train.learning_rate.")


def plotting() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss(history: list[dict[str, Any]], path: Path) -> None:
    if not history:
        return
    plt = plotting()

    rows = [r for r in history if "loss" in r]
    steps = [r["step"] for r in rows]
    losses = [r["loss"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, losses, lw=1, alpha=0.5, label="training loss")
    k = max(1, len(losses) // 10)
    if len(losses) > k > 1:
        smooth = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(steps, smooth, lw=2, label=f"moving mean ({k})")
    val = [r for r in history if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", lw=2, label="validation loss")
    ax.set_xlabel("optimizer update")
    ax.set_ylabel("loss")
    ax.set_title(path.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic.atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)

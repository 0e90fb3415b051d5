"""Timing and memory figures shared by training, evaluation and benchmarks."""

from __future__ import annotations

import resource
import statistics
import sys
import time
from typing import Any

import torch

from ..util.devices import is_cuda


def reset_peaks(device: torch.device) -> None:
    if is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)


def memory(device: torch.device) -> dict[str, Any]:
    """Peak device memory (allocated, reserved) and host RSS, in bytes."""
    import psutil

    # ru_maxrss is in KiB on Linux, bytes on macOS.
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    out: dict[str, Any] = {"rss": psutil.Process().memory_info().rss, "peak_rss": peak_rss,
                           "peak_allocated": None, "peak_reserved": None}
    if is_cuda(device):
        out["peak_allocated"] = torch.cuda.max_memory_allocated(device)
        out["peak_reserved"] = torch.cuda.max_memory_reserved(device)
    return out


def gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def steady_state(seconds: list[float], warmup: int) -> dict[str, float | int | None]:
    """Median, mean and spread of per-update times after ``warmup`` updates (warm-up excluded).

    The median describes a typical update; the mean is what totals are made of (time = n × mean),
    so projections and estimates use the mean.
    """
    measured = seconds[warmup:] if len(seconds) > warmup else []
    if not measured:
        return {"median": None, "mean": None, "p10": None, "p90": None, "n": 0, "warmup": warmup}
    q = statistics.quantiles(measured, n=10) if len(measured) >= 2 else [measured[0]] * 9
    return {"median": statistics.median(measured), "mean": statistics.fmean(measured), "p10": q[0], "p90": q[-1],
            "n": len(measured), "warmup": warmup}


def fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class StageTimer:
    """Seconds of one update in each of ``loop.step``'s stages (forward, backward, optimizer; summed
    over micro-batches), from CUDA events on the compute stream (on the CPU, the clock)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.marks = device, []

    def mark(self, stage: str) -> None:
        if is_cuda(self.device):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((stage, event))
        else:
            self.marks.append((stage, time.perf_counter()))

    def seconds(self) -> dict[str, float]:
        if is_cuda(self.device):
            torch.cuda.synchronize(self.device)
        out = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        for (stage, a), (_, b) in zip(self.marks, self.marks[1:]):
            dt = a.elapsed_time(b) / 1e3 if is_cuda(self.device) else b - a
            out[stage] = out.get(stage, 0.0) + dt
        out["total"] = sum(out.values())
        return {k: round(v, 6) for k, v in out.items()}

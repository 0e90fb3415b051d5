"""How many swapped blocks to copy ahead (``memory.swap_prefetch = 0``, "auto"), chosen from what
the first updates measure.

A swapped block's copy must be finished when the block starts; otherwise the compute stream waits
(a stall). One block of prefetch hides a copy behind one block's compute, which is enough while a
copy is shorter than a block's compute. When it is longer (a FLUX double block: about 7 ms at
PCIe 5, 14 ms at PCIe 4, against about 4 ms of compute at 1024 px), a run of swapped blocks stalls
on every one of them, unless the copies start earlier, behind the resident blocks that run before
them: that takes more device buffers (slots), one block's bytes each.

The tuner measures, on one forward pass after a warm-up pass, each block's compute time and each
copy's time (CUDA events: the side stream's copies and the compute stream's blocks, each timed
from the moment it actually starts), then replays the engine's schedule (:func:`forward_stall`)
for each prefetch depth and takes the smallest depth whose stall is within 2 % of the forward
pass's compute of the best one the card has room for. Only forward is replayed: in backward each
block recomputes its forward and runs its backward (about 3x the forward compute) behind one copy.
The slots are added once, right after the measurement; nothing changes after that.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..util.devices import is_cuda

MAX_DEPTH = 6  # swapped blocks copied ahead at most (slots per block shape = depth + 1)
GOOD_ENOUGH = 0.02  # a stall within this share of the forward compute of the best depth's is as good


def forward_stall(pools: Sequence[int | None], compute: Sequence[float], copy: dict[int, float],
                  depth: int) -> float:
    """Seconds the compute stream waits for copies in one forward pass, the engine's schedule
    replayed: ``pools[i]`` is block ``i``'s pool (None: resident), ``compute[i]`` its compute time,
    ``copy[p]`` one copy of a pool ``p`` block, ``depth`` the lookahead (``depth + 1`` slots a pool).

    As in :class:`~.swap.BlockSwapper`: the pass starts with the first swapped blocks of each pool in
    their slots (backward ended on them); before block ``i`` runs it is loaded if missing (a demand
    copy) and the next ``depth`` swapped blocks are prefetched into slots holding no block of that
    window (least recently used first); a copy starts when the copy stream is free and the compute
    stream has reached the point where it was issued (the slot's *free* event); copies run one after
    the other."""
    swapped = [i for i, p in enumerate(pools) if p is not None]
    position = {b: k for k, b in enumerate(swapped)}
    slots: dict[int, list[int | None]] = {}
    for p in {p for p in pools if p is not None}:
        members = [b for b in swapped if pools[b] == p]
        slots[p] = members[: min(depth + 1, len(members))]
    ready = {b: 0.0 for occupants in slots.values() for b in occupants if b is not None}
    # Backward ran last to first, so the first blocks were used last: the least recent is the latest.
    last_use = {b: -1.0 - position[b] for b in swapped}
    copy_clock = gpu = stall = 0.0

    def load(j: int, protect: set[int], at: float) -> None:
        nonlocal copy_clock
        occupants = slots[pools[j]]
        if None in occupants:
            k = occupants.index(None)
        else:
            free = [k for k, b in enumerate(occupants) if b not in protect]
            if not free:
                return  # every slot holds a block needed sooner: loaded on demand later
            k = min(free, key=lambda k: last_use[occupants[k]])
            ready.pop(occupants[k])
        occupants[k] = j
        copy_clock = max(copy_clock, at) + copy[pools[j]]
        ready[j] = copy_clock

    for i, (p, t) in enumerate(zip(pools, compute)):
        pos = position[i] + 1 if p is not None else next((position[b] for b in swapped if b > i), len(swapped))
        window = swapped[pos: pos + depth]
        protect = {i, *window}
        if p is not None and i not in ready:
            load(i, protect, gpu)
        start = max(gpu, ready[i]) if p is not None else gpu
        stall += start - gpu
        for j in window:
            if j not in ready:
                load(j, protect, start)
        if p is not None:
            last_use[i] = float(i)
        gpu = start + t
    return stall


@dataclass
class Choice:
    depth: int
    stall: dict[int, float]  # seconds of forward stall at each depth tried
    extra_bytes: int  # device buffers added for ``depth`` over the starting depth
    limited_by_memory: bool  # a deeper setting would have stalled less but did not fit


def choose_depth(pools: Sequence[int | None], compute: Sequence[float], copy: dict[int, float],
                 block_bytes: dict[int, int], members: dict[int, int], current: int, allowance: int,
                 max_depth: int = MAX_DEPTH) -> Choice:
    """The smallest depth from ``current`` up whose forward stall is within :data:`GOOD_ENOUGH` of the
    forward compute of the least stall among depths whose added slots fit in ``allowance`` bytes."""
    def extra(d: int) -> int:
        return sum((min(d + 1, n) - min(current + 1, n)) * block_bytes[p] for p, n in members.items())

    stall: dict[int, float] = {}
    limited = False
    for d in range(current, max_depth + 1):
        if extra(d) > allowance:
            limited = True
            break
        stall[d] = forward_stall(pools, compute, copy, d)
        if stall[d] == 0.0 or d + 1 >= max(members.values(), default=0):
            break  # nothing left to hide, or every block of every pool has a slot
    best = min(stall.values())
    slack = GOOD_ENOUGH * sum(compute)
    depth = min(d for d, s in stall.items() if s <= best + slack)
    if limited:  # did memory stop a depth that would have stalled less?
        limited = min(forward_stall(pools, compute, copy, d) for d in range(max(stall) + 1, max_depth + 1)) \
            < stall[depth] - slack
    return Choice(depth, stall, extra(depth), limited)


# ----------------------------------------------------------------------------------- measuring


def _mark(stream: Any) -> Any:
    """A timestamp on ``stream`` (CUDA: an event recorded there), or the wall clock without CUDA
    (host copies are synchronous there, so the wall clock times them)."""
    if stream is None:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def _seconds(start: Any, end: Any) -> float:
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1000.0


@dataclass
class PrefetchTuner:
    """Plugged into a :class:`~.swap.BlockSwapper`: measures forward pass ``measure_on`` (and the
    copies issued until the next one), then asks for the depth :func:`choose_depth` gives.
    ``allowance()``: device bytes the added slots may take (read when deciding, after the measured
    update's peak). ``report(message, facts)``: what was decided, for the log and the run record."""

    allowance: Callable[[], int]
    report: Callable[[str, dict[str, Any]], None]
    grow: bool = True  # False (an explicit memory.swap_prefetch): measure and say what auto would choose
    measure_on: int = 2
    max_depth: int = MAX_DEPTH
    forwards: int = 0
    measuring: bool = False
    done: bool = False
    copies: list[tuple[int, Any, Any]] = field(default_factory=list)  # (pool, start, end)
    runs: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # block -> (start, end), forward
    _open: dict[int, Any] = field(default_factory=dict)

    def forward_starts(self, swapper: Any) -> None:
        """Called by the engine before each forward pass."""
        if self.done:
            return
        self.forwards += 1
        if self.measuring:
            self.measuring = False
            self.done = True
            self._decide(swapper)
        elif self.forwards == self.measure_on:
            self.measuring = True

    def copy_marks(self, stream: Any) -> Any:
        return _mark(stream) if self.measuring else None

    def copied(self, pool: int, start: Any, stream: Any) -> None:
        if start is not None:
            self.copies.append((pool, start, _mark(stream)))

    def block_starts(self, index: int, stream: Any) -> None:
        if self.measuring and index not in self.runs:
            self._open[index] = _mark(stream)

    def block_ends(self, index: int, stream: Any) -> None:
        if self.measuring and index in self._open:
            self.runs[index] = (self._open.pop(index), _mark(stream))

    def _decide(self, swapper: Any) -> None:
        if is_cuda(swapper.device):
            torch.cuda.synchronize(swapper.device)
        pools, block_bytes, members = swapper.layout()
        current = swapper.lookahead
        facts: dict[str, Any] = {"auto": self.grow, "depth": current, "measured_forward": self.measure_on}
        copy: dict[int, list[float]] = {}
        for p, start, end in self.copies:
            copy.setdefault(p, []).append(_seconds(start, end))
        cycling = {p for p, n in members.items() if n > current + 1}  # pools whose blocks do not all stay in slots
        if len(self.runs) < len(pools) or not cycling <= set(copy):
            facts.update(reason="not every block ran or was copied in the measured pass")
            self.report(f"block swap: prefetch stays at {current} block(s) ahead ({facts['reason']})", facts)
            return
        copy_s = {p: statistics.median(v) for p, v in copy.items()}  # (a pool that never cycles copies nothing)
        compute = [_seconds(*self.runs[i]) for i in range(len(pools))]
        choice = choose_depth(pools, compute, copy_s, block_bytes, members, current, self.allowance(),
                              self.max_depth)
        per_pool = {p: statistics.median(compute[i] for i in range(len(pools)) if pools[i] == p) for p in members}
        depth = choice.depth if self.grow else current
        facts.update(depth=depth, extra_device_bytes=choice.extra_bytes if self.grow else 0,
                     auto_would_choose=choice.depth, limited_by_memory=choice.limited_by_memory,
                     copy_ms={str(p): round(1e3 * s, 3) for p, s in copy_s.items()},
                     compute_ms={str(p): round(1e3 * s, 3) for p, s in per_pool.items()},
                     forward_compute_ms=round(1e3 * sum(compute), 3),
                     forward_stall_ms={str(d): round(1e3 * s, 3) for d, s in choice.stall.items()})
        shapes = ", ".join(f"copy {1e3 * copy_s[p]:.2f} ms / compute {1e3 * per_pool[p]:.2f} ms"
                           for p in sorted(copy_s))
        stalls = ", ".join(f"{d}: {1e3 * s:.1f} ms" for d, s in choice.stall.items())
        if depth > current:
            try:
                swapper.grow(depth)
            except torch.OutOfMemoryError:
                facts.update(depth=current, extra_device_bytes=0, reason=f"out of memory adding the slots of {depth}")
                self.report(f"block swap: prefetch stays at {current} block(s) ahead (out of memory adding the slots "
                            f"for {depth})", facts)
                return
        grown = (f"{depth} blocks ahead (+{choice.extra_bytes / 2**20:.0f} MiB of device buffers)"
                 if depth > current else f"{current} block(s) ahead")
        how = f"from update {self.measure_on}'s forward" if self.grow else \
            f"as set (memory.swap_prefetch = {current}; auto would choose {choice.depth})"
        tail = "; a deeper prefetch would stall less but the card has no room for it" \
            if choice.limited_by_memory else ""
        self.report(f"block swap: prefetch {grown}, {how} ({shapes} per block of each swapped shape; forward "
                    f"stall by depth {stalls}){tail}", facts)

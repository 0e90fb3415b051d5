"""memory.swap_prefetch = 0 (auto): the replayed schedule, the choice of depth, and the tuner inside
the engine (on the CPU path and on the CUDA path against a recording stand-in with a fake clock)."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_swap import FakeCuda, assert_same_training, build_toy, check_residency, toy_batches, toy_loss, train

from imglora.memory import BlockSwapper, SwapEvent, swap_mask, to_device
from imglora.memory import swap_tune
from imglora.memory.swap_tune import PrefetchTuner, choose_depth, forward_stall

# ----------------------------------------------------------------------------- the replayed schedule


def test_forward_stall_hand_checked() -> None:
    # 1 resident block, then 3 swapped ones of one shape; compute 1, copy 3. Depth 1 (2 slots): the
    # pass starts with blocks 1 and 2 in their slots (backward ended on them); block 3's copy can
    # start only when block 2 starts (t=2, its slot's block 1 is done) and ends at 5: block 3 waits 2.
    seq, compute = [None, 0, 0, 0], [1.0] * 4
    assert forward_stall(seq, compute, {0: 3.0}, 1) == 2.0
    assert forward_stall(seq, compute, {0: 3.0}, 2) == 0.0  # 3 slots: every block stays in one
    # 3 resident then 5 swapped, compute 1, copy 2 (a copy slower than a block's compute):
    # depth 1 waits 1 on each of blocks 5, 6, 7; depth 2 only on 7; depth 3 never (worked by hand
    # in the module's model: copies start at the issuing block's start, one after the other).
    seq, compute = [None] * 3 + [0] * 5, [1.0] * 8
    assert [forward_stall(seq, compute, {0: 2.0}, d) for d in (1, 2, 3)] == [3.0, 1.0, 0.0]
    assert forward_stall(seq, compute, {0: 0.5}, 1) == 0.0  # copies shorter than compute: hidden
    assert forward_stall([None, None], [1.0, 1.0], {}, 1) == 0.0  # nothing swapped


def test_forward_stall_with_two_shapes() -> None:
    # FLUX-like: resident doubles, swapped doubles (slow copies), resident singles, swapped singles
    seq = [None] * 4 + [0] * 4 + [None] * 4 + [1] * 6
    compute = [4.0] * 8 + [1.6] * 10
    copy = {0: 7.0, 1: 2.8}
    stalls = [forward_stall(seq, compute, copy, d) for d in range(1, 7)]
    assert stalls[0] > 0  # one ahead cannot hide 7 ms copies behind 4 ms blocks
    assert all(a >= b for a, b in itertools.pairwise(stalls)), stalls  # deeper never stalls more here
    assert stalls[-1] < stalls[0] / 2


def test_choose_depth_smallest_good_enough_and_within_memory() -> None:
    seq, compute, copy = [None] * 3 + [0] * 5, [1.0] * 8, {0: 2.0}
    big = choose_depth(seq, compute, copy, {0: 100}, {0: 5}, current=1, allowance=10**9)
    assert (big.depth, big.extra_bytes, big.limited_by_memory) == (3, 200, False)
    assert big.stall == {1: 3.0, 2: 1.0, 3: 0.0}  # stops at the first depth with nothing left to hide
    tight = choose_depth(seq, compute, copy, {0: 100}, {0: 5}, current=1, allowance=150)
    assert (tight.depth, tight.extra_bytes, tight.limited_by_memory) == (2, 100, True)
    none = choose_depth(seq, compute, copy, {0: 100}, {0: 5}, current=1, allowance=0)
    assert (none.depth, none.extra_bytes, none.limited_by_memory) == (1, 0, True)
    fast = choose_depth(seq, compute, {0: 0.5}, {0: 100}, {0: 5}, current=1, allowance=10**9)
    assert (fast.depth, fast.extra_bytes, fast.limited_by_memory) == (1, 0, False)
    # a stall within 2 % of the forward compute of the best is as good: the smaller depth wins
    almost = choose_depth(seq, compute, {0: 1.01}, {0: 100}, {0: 5}, current=1, allowance=10**9)
    assert almost.depth == 1 and almost.stall[1] <= 0.02 * sum(compute)


# ------------------------------------------------------------------------------ inside the engine


def tuned_run(monkeypatch, depth_wanted: int, allowance: int = 10**9, grow: bool = True, device: str = "cpu"):
    """3 training steps of the toy (7 of 8 blocks swapped: 5 of one shape, 2 of another) with a
    tuner whose replay says ``depth_wanted`` hides everything."""
    monkeypatch.setattr(swap_tune, "forward_stall", lambda pools, compute, copy, d: 0.0 if d >= depth_wanted else 1.0)
    reports: list[tuple[str, dict]] = []
    tuner = PrefetchTuner(lambda: allowance, lambda msg, facts: reports.append((msg, facts)), grow=grow)
    m = build_toy("nonreentrant")
    sw = BlockSwapper(list(m.blocks), swap_mask(8, 7), device, record_events=True, tuner=tuner)
    sw.install(root=m)
    got = train(m, toy_batches(3, device), toy_loss, sw)
    return sw, got, reports


def test_tuner_deepens_once_and_training_is_unchanged(monkeypatch) -> None:
    ref = train(build_toy("nonreentrant"), toy_batches(3), toy_loss)
    sw, got, reports = tuned_run(monkeypatch, depth_wanted=3)
    assert_same_training(ref, got)
    check_residency(sw.stats.events)
    assert sw.lookahead == 3 and sw.slots_per_shape == 4
    assert [(p.n_blocks, p.n_slots) for p in sw.stats.pools] == [(5, 4), (2, 2)]
    assert sw.stats.buffer_allocations == sw.stats.slots == 6  # 2 + 2 at install, 2 more once
    [(msg, facts)] = reports  # decided once, before the third forward
    assert "prefetch 3 blocks ahead" in msg and "from update 2's forward" in msg
    block_bytes = sw.stats.pools[0].block_bytes
    assert facts["depth"] == 3 and facts["extra_device_bytes"] == 2 * block_bytes
    # pool 1's two blocks never leave their two slots: only pool 0's copies are timed
    assert set(facts["copy_ms"]) == {"0"} and facts["copy_ms"]["0"] > 0
    assert set(facts["compute_ms"]) == {"0", "1"} and facts["forward_compute_ms"] > 0
    assert facts["forward_stall_ms"] == {"1": 1000.0, "2": 1000.0, "3": 0.0}
    # when block 1 starts its third forward, the 3 swapped blocks after it are resident (or on their
    # way); in the first two forwards only the next one was
    resident: set[int] = set()
    ahead = []
    for e in sw.stats.events:
        if e.kind == "load":
            resident.add(e.block)
        elif e.kind == "evict":
            resident.discard(e.block)
        elif e == SwapEvent("run", 2, "forward"):
            ahead.append(sorted(b for b in resident if b > 1))
    assert ahead[0][:1] == ahead[1][:1] == [2] and 4 not in ahead[0] + ahead[1]
    assert ahead[2][:3] == [2, 3, 4]


def test_tuner_stays_where_the_card_has_no_room(monkeypatch) -> None:
    sw, _, reports = tuned_run(monkeypatch, depth_wanted=4, allowance=0)
    assert sw.lookahead == 1 and sw.stats.slots == 4
    [(msg, facts)] = reports
    assert facts["depth"] == 1 and facts["limited_by_memory"] and facts["extra_device_bytes"] == 0
    assert "prefetch 1 block(s) ahead" in msg and "the card has no room" in msg


def test_an_explicit_depth_is_kept_and_the_record_says_what_auto_would_choose(monkeypatch) -> None:
    sw, _, reports = tuned_run(monkeypatch, depth_wanted=3, grow=False)
    assert sw.lookahead == 1 and sw.stats.slots == 4 and sw.stats.buffer_allocations == 4
    [(msg, facts)] = reports
    assert not facts["auto"] and facts["depth"] == 1 and facts["auto_would_choose"] == 3
    assert facts["extra_device_bytes"] == 0
    assert "prefetch 1 block(s) ahead, as set (memory.swap_prefetch = 1; auto would choose 3)" in msg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tuner_grows_on_the_gpu_and_training_is_unchanged(monkeypatch) -> None:
    """The real CUDA path: timing events on both streams, elapsed times read after a synchronize,
    slots added on the device between two updates; training equals the unswapped model's."""
    ref_model = build_toy("nonreentrant")
    to_device(ref_model, "cuda")
    ref = train(ref_model, toy_batches(3, "cuda"), toy_loss)
    sw, got, reports = tuned_run(monkeypatch, depth_wanted=3, device="cuda")
    assert_same_training(ref, got, rtol=1e-4, atol=1e-5)
    assert sw.lookahead == 3 and [(p.n_blocks, p.n_slots) for p in sw.stats.pools] == [(5, 4), (2, 2)]
    [(_, facts)] = reports
    assert facts["copy_ms"]["0"] > 0 and facts["forward_compute_ms"] > 0
    sw.remove()


class TimedFakeCuda(FakeCuda):
    """FakeCuda whose events carry a fake clock (each record one millisecond later)."""

    def __init__(self) -> None:
        super().__init__()
        clock = itertools.count()
        base, log = self.Event, self.log

        class Event(base):
            def __init__(self, enable_timing: bool = False) -> None:
                self.timing, self.t = enable_timing, None

            def record(self, stream):
                self.t = next(clock)
                log.append(("record", self, stream))

            def elapsed_time(self, end) -> float:
                assert self.timing and end.timing, "elapsed_time needs events made with enable_timing=True"
                return float(end.t - self.t)

        self.Event = Event


def test_tuner_on_the_cuda_path_times_after_the_waits(monkeypatch) -> None:
    fake = TimedFakeCuda()
    fake.install(monkeypatch)
    reports: list[tuple[str, dict]] = []
    tuner = PrefetchTuner(lambda: 10**9, lambda msg, facts: reports.append((msg, facts)))
    m = build_toy("nonreentrant", fp8=True)
    sw = BlockSwapper(list(m.blocks), swap_mask(8, 7), "cpu", tuner=tuner)
    sw._cuda = True  # the CUDA code path on CPU tensors
    sw.install()
    ref = train(build_toy("nonreentrant", fp8=True), toy_batches(3), toy_loss)
    got = train(m, toy_batches(3), toy_loss, sw)
    assert_same_training(ref, got)
    [(msg, facts)] = reports
    assert facts["auto"] and facts["depth"] >= 1 and set(facts["copy_ms"]) == {"0"}
    timed = [(pos, e) for pos, e in enumerate(fake.log) if e[0] == "record" and e[1].timing]
    assert timed, "no timing event recorded"
    copy_stream = sw._copy_stream
    starts = ends = 0
    for pos, (_, event, stream) in timed:
        if stream is copy_stream:
            prev = fake.log[pos - 1]
            if prev[0] == "wait":  # a copy's start: on the copy stream right after it waited for the slot
                assert prev[1] is copy_stream
                starts += 1
            else:  # its end: right after the slot's ready event
                assert prev[0] == "record" and not prev[1].timing and prev[2] is copy_stream
                ends += 1
    assert starts == ends > 0
    assert {e[2].name for _, e in timed} == {"copy", "compute"}
    assert ("synchronize",) not in fake.log  # the fake device is "cpu": no synchronize asked
    sw.remove()


def test_out_of_memory_while_adding_slots_keeps_the_depth(monkeypatch) -> None:
    def no_room(self, depth):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 340.00 MiB")

    monkeypatch.setattr(BlockSwapper, "grow", no_room)
    ref = train(build_toy("nonreentrant"), toy_batches(3), toy_loss)
    sw, got, reports = tuned_run(monkeypatch, depth_wanted=3)
    assert_same_training(ref, got)  # training goes on at the depth it had
    assert sw.lookahead == 1 and sw.stats.slots == 4
    [(msg, facts)] = reports
    assert facts["depth"] == 1 and facts["reason"] == "out of memory adding the slots of 3"
    assert "stays at 1 block(s) ahead (out of memory adding the slots for 3)" in msg

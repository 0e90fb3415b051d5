"""The block-swap engine's CUDA path rehearsed on the CPU, against a stand-in GPU that models
asynchronous copies (tests/cuda_standin.py: AsyncCuda): side-stream copies are in flight until a
wait orders them, and every kernel's reads and writes are checked against the streams' order.

Swap on, as the trainer installs it (memory/wrap.py: ``slots_per_shape = depth + 1`` and the
prefetch tuner of ``memory.swap_prefetch = 0``), on a tiny FLUX transformer with fp8 weights and
gradient checkpointing: training equals training without swap (so no copy was read before it
landed), with no ordering violation, with copies landing as late as allowed and at random (several
seeds). Then two bugs are planted in the engine and the stand-in must name each."""

from __future__ import annotations

import pytest
import torch
from cuda_standin import AsyncCuda, OrderingViolation
from test_swap import (assert_same_training, build_flux, build_toy, flux_batches, flux_blocks, flux_loss,
                       toy_batches, toy_loss, train)

from imglora.memory import BlockSwapper, swap_mask
from imglora.memory.swap_tune import PrefetchTuner


@pytest.fixture
def standin(monkeypatch):
    """``standin(**kw)`` installs an AsyncCuda for the test; violations left in it fail the test."""
    made: list[AsyncCuda] = []

    def make(**kw) -> AsyncCuda:
        fake = AsyncCuda(**kw)
        fake.install(monkeypatch)
        made.append(fake)
        return fake

    yield make
    for fake in made:
        fake.check()


def installed(build, blocks_of, fake: AsyncCuda, depth: int = 0, reports: list | None = None):
    """The model and its swapper as memory/wrap.py's apply_memory installs them, on the CUDA path."""
    model = build()
    blocks, mask = blocks_of(model)
    tuner = PrefetchTuner(lambda: 10**9, lambda msg, facts: (reports if reports is not None else []).append(msg),
                          grow=depth == 0)
    sw = BlockSwapper(blocks, mask, "cpu", slots_per_shape=max(depth, 1) + 1, tuner=tuner)
    sw._cuda = True  # the CUDA code path, on CPU tensors the stand-in calls device memory
    with fake.active():
        sw.install(root=model)
    return model, sw


FLUX = (lambda: build_flux(ckpt=True, fp8=True), flux_blocks, flux_batches, flux_loss)
TOY = (lambda: build_toy("nonreentrant", fp8=True), lambda m: (list(m.blocks), swap_mask(8, 7)), toy_batches,
       toy_loss)


@pytest.mark.parametrize("fuzz", [None, 0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_flux_swap_on_the_cuda_path_orders_every_copy(standin, fuzz) -> None:
    build, blocks_of, batches_of, loss = FLUX
    batches = batches_of(2)
    ref = train(build(), batches, loss)
    fake = standin(fuzz=fuzz)
    model, sw = installed(build, blocks_of, fake)
    assert sw.stats.pinned and set(fake.host.values()) == {"registered"}
    with fake.active():
        got = train(model, batches, loss, sw)
        sw.remove()
    assert_same_training(ref, got)  # every slot read saw its block's bytes: each copy had landed
    assert fake.violations == []
    assert not fake.in_flight and not fake.host  # remove() waited for the copies and unregistered
    loads = sw.stats.loads
    assert loads > sum(p.n_slots for p in sw.stats.pools)  # slots were reused: copies into busy slots
    # fuzz: some copies landed before the wait that ordered them; without it, each at that wait
    assert (fake.landed_early > 0) == (fuzz is not None)


@pytest.mark.parametrize("fuzz", [None, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("ckpt", [None, "nonreentrant", "reentrant"])
def test_toy_every_checkpoint_mode(standin, ckpt, fuzz) -> None:
    """Without checkpointing (saved weight views rebuilt on their slot), and both checkpoint kinds."""
    batches = toy_batches(2)
    ref = train(build_toy(ckpt, fp8=True), batches, toy_loss)
    fake = standin(fuzz=fuzz)
    model, sw = installed(lambda: build_toy(ckpt, fp8=True), TOY[1], fake, depth=1)
    with fake.active():
        got = train(model, batches, toy_loss, sw)
    assert_same_training(ref, got)
    assert fake.violations == [] and sw.stats.loads > sw.stats.slots


@pytest.mark.parametrize("fuzz", [None, 3])
def test_toy_with_the_tuner_growing_the_slots(standin, fuzz) -> None:
    """Three updates: update 2 is measured on the stand-in's clock, slots are added before update 3."""
    build, blocks_of, batches_of, loss = TOY
    batches = batches_of(3)
    ref = train(build(), batches, loss)
    fake, reports = standin(fuzz=fuzz), []
    model, sw = installed(build, blocks_of, fake, reports=reports)
    with fake.active():
        got = train(model, batches, loss, sw)
    assert_same_training(ref, got)
    assert len(reports) == 1 and "block swap: prefetch" in reports[0]
    assert fake.violations == []


# ------------------------------------------------------------------------------------ planted bugs


def drop_first_wait(stream, skip) -> None:
    """Make ``stream`` ignore the first wait_event whose event ``skip(event)`` selects."""
    real, done = stream.wait_event, [False]

    def wait_event(event) -> None:
        if not done[0] and skip(event):
            done[0] = True
            stream.log_dropped = event
            return
        real(event)

    stream.wait_event = wait_event


def test_a_removed_ready_wait_is_caught(standin) -> None:
    """The compute stream does not wait for block 10's copy before block 10 runs its forward (update 2)."""
    build, blocks_of, batches_of, loss = FLUX
    batches = batches_of(2)
    ref = train(build(), batches, loss)
    fake = standin()
    model, sw = installed(build, blocks_of, fake)
    ready = {id(s.ready) for p in sw._pools for s in p.slots}
    forwards = []
    orig_prepare = sw.prepare_forward
    sw.prepare_forward = lambda: (forwards.append(1), orig_prepare())[1]
    drop_first_wait(fake.compute, lambda e: id(e) in ready and sw._current == 10 and len(forwards) == 2)
    with fake.active():
        got = train(model, batches, loss, sw)
    assert fake.compute.log_dropped is not None
    assert any("reads device memory that a non_blocking copy on the copy stream writes: read before its copy "
               "was waited on" in v for v in fake.violations), fake.violations
    with pytest.raises(OrderingViolation, match=r"CUDA ordering violation\(s\)"):
        fake.check()
    # and the numbers show it: block 10 ran on the bytes its slot held before the copy landed
    with pytest.raises(AssertionError, match="step 1"):
        assert_same_training(ref, got)
    fake.violations.clear()


def test_a_slot_reused_before_its_free_event_is_caught(standin) -> None:
    """The copy stream does not wait for a slot's free event: the copy may overwrite the bytes of
    the block that left the slot while the compute stream's kernels still read them."""
    build, blocks_of, batches_of, loss = TOY
    fake = standin(fuzz=5)
    model, sw = installed(build, blocks_of, fake, depth=1)
    slot_of = {id(s.free): s for p in sw._pools for s in p.slots}

    def was_read(event) -> bool:  # the slot's previous block was read by kernels since its copy
        slot = slot_of.get(id(event))
        history = fake.history.get(slot.buf.untyped_storage().data_ptr()) if slot is not None else None
        return history is not None and bool(history.reads)

    drop_first_wait(sw._copy_stream, was_read)
    with fake.active():
        train(model, batches_of(2), loss, sw)
    assert sw._copy_stream.log_dropped is not None
    assert any("a non_blocking copy on the copy stream overwrites device memory while" in v
               and "queued earlier on the compute stream may still read it" in v for v in fake.violations), \
        fake.violations
    fake.violations.clear()


def test_a_block_run_from_host_memory_is_caught(standin, monkeypatch) -> None:
    """A swapped block that runs without being loaded reads its weights from page-locked host memory:
    a device mismatch on a GPU."""
    build, blocks_of, batches_of, loss = TOY
    fake = standin()
    model, sw = installed(build, blocks_of, fake, depth=1)
    acquire, load = BlockSwapper._acquire, BlockSwapper._load

    def no_acquire(self, index, phase, direction):
        if index != 7:  # block 7: no load, no wait; its parameters still point at its host copy
            acquire(self, index, phase, direction)

    def no_prefetch(self, index, phase, protect, *, demand):
        return True if index == 7 else load(self, index, phase, protect, demand=demand)

    monkeypatch.setattr(BlockSwapper, "_acquire", no_acquire)
    monkeypatch.setattr(BlockSwapper, "_load", no_prefetch)
    with fake.active():
        with torch.no_grad():
            loss(model, batches_of(1)[0], sw)
    assert any("reads registered host memory as a kernel argument (a device mismatch on a GPU" in v
               for v in fake.violations), fake.violations
    fake.violations.clear()


def test_a_failed_host_register_does_not_poison_the_next_kernel(standin) -> None:
    """cudaHostRegister fails (a low locked-memory limit): the engine falls back to the pinned
    allocator, and the first kernel must not raise the stale error."""
    build, blocks_of, batches_of, loss = TOY
    fake = standin(register_rc=2)
    model, sw = installed(build, blocks_of, fake, depth=1)
    assert set(fake.host.values()) == {"pinned"} and sw.stats.pinned
    kinds = dict(sw.stats.host_memory)  # what the record's swap facts say was used
    assert set(kinds) == {"pinned"} and kinds["pinned"] >= sum(p.block_bytes * len(p.members) for p in sw._pools)
    with fake.active():
        train(model, batches_of(1), loss, sw)
    assert fake.last_error is None


def test_clearing_the_last_error_uses_the_runtime_torch_loaded(monkeypatch) -> None:
    """torch.cuda.cudart() has no cudaGetLastError: the runtime library found in the process's memory
    map is called through ctypes; where there is none (this CPU-only build), clearing says so."""
    from imglora.memory import swap_storage

    monkeypatch.setattr(torch.cuda, "cudart", lambda: object())
    swap_storage._runtime_get_last_error.cache_clear()
    maps = open("/proc/self/maps").read()
    if "libcudart" not in maps:
        assert swap_storage.clear_cuda_error() is False
    calls = []
    monkeypatch.setattr(swap_storage, "_runtime_get_last_error", lambda: lambda: calls.append(1) or 0)
    assert swap_storage.clear_cuda_error() is True and calls == [1]


# -------------------------------------------------------------- checkpoint boundaries offloaded


def offloaded_flux(swap: bool, fake: AsyncCuda | None = None):
    """Tiny FLUX with fp8 and gradient checkpointing through an OffloadingCheckpoint on the CUDA path
    (its boundaries are a few KiB here, so the size floor is lowered to move them), with or without
    block swap, as apply_memory installs them."""
    from imglora.memory.offload import OffloadingCheckpoint

    model = build_flux(ckpt=True, fp8=True)
    off = OffloadingCheckpoint("cpu", min_bytes=1024)
    model.enable_gradient_checkpointing(gradient_checkpointing_func=off)
    sw = None
    if swap:
        blocks, mask = flux_blocks(model)
        sw = BlockSwapper(blocks, mask, "cpu", slots_per_shape=2)
        with fake.active():
            sw.install(root=model)
    return model, off, sw


@pytest.mark.parametrize("swap,fuzz", [(False, None), (True, 6), pytest.param(True, None, marks=pytest.mark.slow),
                                       pytest.param(False, 7, marks=pytest.mark.slow)])
def test_offloaded_boundaries_go_out_and_come_back_on_the_side_stream(standin, swap, fuzz) -> None:
    """Issue 22, defect 2: the boundaries' copies run on a side stream ordered by events; training
    equals plain checkpointing (each copy had landed before its block read it), with no ordering
    violation, and the host memory is exactly the boundaries' bytes, reused from update to update."""
    batches = flux_batches(2)
    ref = train(build_flux(ckpt=True, fp8=True), batches, flux_loss)
    fake = standin(fuzz=fuzz)
    model, off, sw = offloaded_flux(swap, fake)
    assert off.cuda
    held = []
    with fake.active():
        got = train(model, batches, flux_loss, sw, per_step=lambda: held.append(dict(off.facts["host_memory"])))
    assert_same_training(ref, got)
    assert fake.violations == []
    side = off._stream
    assert side is not None and side is not fake.compute and (sw is None or side is not sw._copy_stream)
    per_update = off.offloaded_bytes // 2
    assert off.calls == 2 * 12 and per_update > 0  # 4 double and 8 single blocks, each update
    assert held == [{"registered": per_update}] * 2  # exactly their size, and update 2 reused them
    assert not off._pending  # every boundary came back and gave its buffers back
    copies = [e for e in fake.log if e[0] == "record" and e[2] is side]
    assert len(copies) == 2 * 2 * 12  # per update and block: one event after going out, one after coming back


def drop_wait_on(stream, events) -> None:
    """``stream`` ignores every wait on an event ``events()`` holds."""
    real = stream.wait_event

    def wait_event(event) -> None:
        if id(event) not in events():
            real(event)

    stream.wait_event = wait_event


def test_offload_without_the_wait_for_the_copy_back_is_caught(standin) -> None:
    """A planted bug: the compute stream does not wait for a boundary's copy back before the block
    recomputes from it."""
    fake = standin()
    model, off, _ = offloaded_flux(False)
    ready: set[int] = set()
    orig = off._bring_back

    def bring_back(entry) -> None:
        orig(entry)
        if entry.ready is not None:
            ready.add(id(entry.ready))

    off._bring_back = bring_back
    drop_wait_on(fake.compute, lambda: ready)
    with fake.active():
        train(model, flux_batches(1), flux_loss)
    assert any("reads device memory that a non_blocking copy on the copy stream writes: read before its copy "
               "was waited on" in v for v in fake.violations), fake.violations
    fake.violations.clear()


def test_offload_copying_before_the_boundary_is_computed_is_caught(standin, monkeypatch) -> None:
    """A planted bug: the side stream does not wait for the compute stream before copying a boundary
    out, so the copy may read it before the block that makes it has run."""
    fake = standin()
    model, off, _ = offloaded_flux(False)
    side = off._side()
    produced: set[int] = set()
    real_record = fake.Event.record

    def record(event, stream=None):
        if (stream if stream is not None else fake.current[-1]) is fake.compute and fake.current[-1] is fake.compute:
            produced.add(id(event))
        return real_record(event, stream)

    monkeypatch.setattr(fake.Event, "record", record)
    drop_wait_on(side, lambda: produced)
    with fake.active():
        train(model, flux_batches(1), flux_loss)
    assert any(v.startswith("a non_blocking copy on the copy stream reads device memory that") for v in fake.violations), \
        fake.violations
    fake.violations.clear()


def test_offload_refuses_a_second_backward_through_one_graph(standin) -> None:
    """The boundaries' buffers are given back after their recompute; a second backward through the
    same graph (retain_graph) is refused with the setting to change, not a crash deep in autograd."""
    fake = standin()
    model, off, _ = offloaded_flux(False)
    with fake.active():
        loss = flux_loss(model, flux_batches(1)[0], None)
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="a second backward through the same graph is not supported with "
                                               r"offloaded checkpoints \(set memory.offload_checkpoints = false\)"):
            loss.backward()

"""Block swapping: schedule invariants and swap-on == swap-off training, on CPU (and CUDA if present).

On CPU the engine runs the same schedule with host-to-host copies, so everything but the memory
saving is checked here: residency before every forward/recompute/backward, slot counts, bytes
moved, and bit-for-bit equal training with LoRA (toy model and a tiny FLUX transformer, with and
without gradient checkpointing, with and without fp8 weights).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch import nn

from cuda_standin import FakeCuda  # noqa: F401 - test_swap_tune imports it from here

from imglora.families.flux.swap import kohya_split
from imglora.memory import BlockSwapper, SwapEvent, quantize_fp8, swap_mask, to_device
from imglora.memory import swap as swap_mod



# ------------------------------------------------------------------------------------ toy model


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x)))) * cond


class Toy(nn.Module):
    """6 residual MLP blocks of one shape, 2 of another; checkpointing like diffusers (block.__call__)."""

    def __init__(self, ckpt: str | None = None, dim: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim, 2 * dim) for _ in range(6)] + [Block(dim, 3 * dim) for _ in range(2)])
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        if self.ckpt == "reentrant":
            x = x.requires_grad_()  # reentrant checkpoint only backpropagates through inputs that need grad
        for b in self.blocks:
            if self.ckpt and torch.is_grad_enabled():
                x = cp.checkpoint(b, x, cond, use_reentrant=self.ckpt == "reentrant")
            else:
                x = b(x, cond)
        return x


def add_lora(model: nn.Module, targets: list[str], seed: int = 5) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, target_modules=targets), model)
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: make LoRA contribute from step one
            p.data = torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05


def build_toy(ckpt: str | None = None, fp8: bool = False) -> Toy:
    torch.manual_seed(0)
    m = Toy(ckpt)
    m.requires_grad_(False)
    add_lora(m, ["fc1", "fc2"])
    if fp8:
        quantize_fp8(m)
    return m


def toy_batches(steps: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 5, 16, generator=g).to(device), torch.randn(4, 1, 16, generator=g).to(device)) for _ in range(steps)]


def toy_loss(m: nn.Module, batch, swapper: BlockSwapper | None) -> torch.Tensor:
    if swapper is not None:
        swapper.prepare_forward()
    x, c = batch
    return m(x, c).pow(2).mean()


# ------------------------------------------------------------------------------------ tiny FLUX

FLUX_LORA = [
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
    "norm1.linear", "norm1_context.linear", "norm.linear", "ff.net.0.proj", "ff.net.2", "proj_mlp", "proj_out",
]  # fmt: skip
FLUX_EXCLUDE = ["x_embedder", "context_embedder", "time_text_embed*", "norm_out*", "proj_out"]


def build_flux(ckpt: bool = False, fp8: bool = False):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    m = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=4, num_single_layers=8, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    m.requires_grad_(False)
    add_lora(m, FLUX_LORA)
    if fp8:
        quantize_fp8(m, exclude=FLUX_EXCLUDE)
    if ckpt:
        m.enable_gradient_checkpointing()
    return m


def flux_batches(steps: int, device: str = "cpu", h: int = 4, w: int = 4, txt: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(2)
    img_ids = torch.zeros(h * w, 3)
    img_ids[:, 1] = torch.arange(h).repeat_interleave(w)
    img_ids[:, 2] = torch.arange(w).repeat(h)
    out = []
    for _ in range(steps):
        b = dict(
            hidden_states=torch.randn(2, h * w, 64, generator=g),
            encoder_hidden_states=torch.randn(2, txt, 32, generator=g),
            pooled_projections=torch.randn(2, 32, generator=g),
            timestep=torch.rand(2, generator=g),
            guidance=torch.ones(2),
            img_ids=img_ids,
            txt_ids=torch.zeros(txt, 3),
        )
        out.append({k: v.to(device) for k, v in b.items()})
    return out


def flux_loss(m: nn.Module, batch: dict, swapper: BlockSwapper | None) -> torch.Tensor:
    if swapper is not None:
        swapper.prepare_forward()
    return m(**batch, return_dict=False)[0].float().pow(2).mean()


def flux_blocks(m) -> tuple[list[nn.Module], list[bool]]:
    # kohya's layout for a small model: the last half of the double and of the single blocks
    blocks = list(m.transformer_blocks) + list(m.single_transformer_blocks)
    return blocks, swap_mask(4, 2) + swap_mask(8, 4)


# ------------------------------------------------------------------------------------ harness


def train(model: nn.Module, batches, loss_fn, swapper: BlockSwapper | None = None, per_step=None):
    """3 AdamW steps; returns per-step losses and LoRA gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses, grads = [], []
    for batch in batches:
        loss = loss_fn(model, batch, swapper)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([p.grad.detach().clone() for p in params])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if per_step is not None:
            per_step()
    return losses, grads


def assert_same_training(ref, got, rtol: float = 1.3e-6, atol: float = 1e-6) -> None:
    for step, (a, b) in enumerate(zip(ref[0], got[0])):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=lambda m: f"loss, step {step}: {m}")
    for step, (ga, gb) in enumerate(zip(ref[1], got[1])):
        assert len(ga) == len(gb)
        for i, (a, b) in enumerate(zip(ga, gb)):
            torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=lambda m: f"LoRA grad {i}, step {step}: {m}")


def frozen_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def check_residency(events) -> None:
    """Replay the log: a block is loaded only into a free slot and runs only while resident."""
    resident: set[int] = set()
    for kind, b, phase in events:
        if kind == "load":
            assert b not in resident, f"block {b} loaded twice"
            resident.add(b)
        elif kind == "evict":
            assert b in resident, f"block {b} evicted while not resident"
            resident.remove(b)
        else:
            assert kind == "run"
            assert b in resident, f"block {b} ran ({phase}) while not resident"


def runs(events) -> list[tuple[int, str]]:
    return [(b, phase) for kind, b, phase in events if kind == "run"]


def expected_runs(swapped: list[int], ckpt: str | bool | None) -> list[tuple[int, str]]:
    fwd = [(b, "forward") for b in swapped]
    if ckpt == "reentrant":  # no output hooks through reentrant checkpoint: the recompute is the entry
        bwd = [(b, "recompute") for b in reversed(swapped)]
    elif ckpt:
        bwd = [x for b in reversed(swapped) for x in ((b, "backward"), (b, "recompute"))]
    else:
        bwd = [(b, "backward") for b in reversed(swapped)]
    return fwd + bwd


def steady_h2d(stats) -> int:
    """Bytes a steady-state step copies: each pool reloads all but its k resident blocks, both ways."""
    return sum(2 * max(p.n_blocks - p.n_slots, 0) * p.block_bytes for p in stats.pools)


def run_equivalence(build, batches, loss_fn, blocks_of, ckpt, slots: int = 2, device: str = "cpu"):
    """Train with and without swapping; check equal training and every schedule invariant.

    On CPU both runs execute the same kernels on the same values: equal to float rounding (in
    practice bit-equal). On CUDA, memory-efficient attention's backward accumulates with atomics,
    so the tolerance there allows run-to-run nondeterminism."""
    tol = dict(rtol=1.3e-6, atol=1e-6) if device == "cpu" else dict(rtol=1e-4, atol=1e-5)
    ref_model = build()
    if device != "cpu":
        to_device(ref_model, device)
    ref = train(ref_model, batches, loss_fn)

    model = build()  # on the CPU: install(root=...) moves all but the swapped weights to the device
    blocks, mask = blocks_of(model)
    swapped = [i for i, s in enumerate(mask) if s]
    before_frozen, before_lora = frozen_state(model), lora_state(model)
    sw = BlockSwapper(blocks, mask, device, slots_per_shape=slots, record_events=True)
    sw.install(root=model)
    if device != "cpu":
        on_host = {id(t) for i in swapped for t in blocks[i].parameters() if not t.requires_grad}
        for t in model.parameters():  # nothing is resident before the first prepare_forward()
            inner = t._data if hasattr(t, "_data") else t  # quanto: look at the fp8 data
            assert inner.is_cuda == (id(t) not in on_host)
    lora_ptrs = {n: p.data_ptr() for n, p in model.named_parameters() if p.requires_grad}
    installed = sw.stats
    snapshots = []
    got = train(model, batches, loss_fn, sw, per_step=lambda: snapshots.append(sw.stats))

    assert_same_training(ref, got, **tol)

    # 1. every swapped block was resident for each forward, recompute and backward, in schedule order
    check_residency(snapshots[-1].events)
    start = 0
    for st in snapshots:
        step_events = st.events[start:]
        start = len(st.events)
        assert runs(step_events) == expected_runs(swapped, ckpt)

    # 2. slot buffers: as configured, all allocated at install, none since
    assert installed.slots == sum(min(slots, p.n_blocks) for p in installed.pools)
    assert all(p.n_slots <= slots for p in installed.pools)
    assert sum(p.n_blocks for p in installed.pools) == len(swapped) == installed.n_swapped
    for st in snapshots:
        assert st.slots == st.buffer_allocations == installed.slots
        assert st.device_buffer_bytes == installed.device_buffer_bytes

    # 3. nothing copied back; the bytes per step are what the schedule implies; with 2+ slots
    #    nothing stalls after the first step (every copy is a prefetch); 1 slot cannot prefetch
    assert all(st.d2h_bytes == 0 for st in snapshots)
    first = sum(p.n_blocks + max(p.n_blocks - p.n_slots, 0) for p in installed.pools)
    assert snapshots[0].loads == first
    for prev, st in zip(snapshots, snapshots[1:]):
        assert st.h2d_bytes - prev.h2d_bytes == steady_h2d(st)
        if slots > 1:
            assert st.demand_loads == prev.demand_loads

    # 5. frozen weights bit-identical, LoRA changed and never moved
    after_frozen = frozen_state(model)
    assert after_frozen.keys() == before_frozen.keys()
    for k, v in before_frozen.items():
        assert torch.equal(after_frozen[k].cpu(), v.cpu()), k
    assert all(not torch.equal(p.detach().cpu(), before_lora[n].cpu()) for n, p in model.named_parameters() if p.requires_grad)
    assert lora_ptrs == {n: p.data_ptr() for n, p in model.named_parameters() if p.requires_grad}

    # remove(): hooks gone, weights back on the device in their own storage, same function
    sw.remove()
    n_events = len(sw.stats.events)
    with torch.no_grad():
        y_removed = loss_fn(model, batches[0], None)
        y_ref = loss_fn(ref_model, batches[0], None)
    torch.testing.assert_close(y_removed, y_ref, **tol)
    assert len(sw.stats.events) == n_events
    for k, v in frozen_state(model).items():
        assert torch.equal(v.cpu(), before_frozen[k].cpu()), k
    return snapshots[-1]


# ------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize("ckpt", [None, "nonreentrant", "reentrant"])
def test_toy_swap_matches_no_swap(ckpt, fp8) -> None:
    batches = toy_batches(3)
    run_equivalence(
        lambda: build_toy(ckpt, fp8), batches, toy_loss, lambda m: (list(m.blocks), swap_mask(8, 7)), ckpt
    )


@pytest.mark.parametrize("slots", [1, 3])
def test_toy_other_slot_counts(slots) -> None:
    run_equivalence(
        lambda: build_toy(None), toy_batches(3), toy_loss, lambda m: (list(m.blocks), swap_mask(8, 7)), None, slots
    )


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize("ckpt", [False, True], ids=["no-ckpt", "ckpt"])
def test_flux_swap_matches_no_swap(ckpt, fp8) -> None:
    stats = run_equivalence(lambda: build_flux(ckpt, fp8), flux_batches(3), flux_loss, flux_blocks, ckpt)
    # double and single blocks have different layouts: two pools
    assert [p.n_blocks for p in stats.pools] == [2, 4]


def test_saved_weight_views_survive_slot_reuse() -> None:
    """Without checkpointing autograd saves views of weights (``weight.t()`` for F.linear). A
    no-grad forward between forward and backward (e.g. a target from the same model) re-deals the
    slots, so those views would read other blocks' weights; the engine's saved-tensor hooks rebuild
    them on the block's current slot. The same run with the hooks disabled must differ, which
    proves this test exercises the hazard."""

    def loss_with_target(m, batch, swapper):
        if swapper is not None:
            swapper.prepare_forward()
        x, c = batch
        pred = m(x, c)
        with torch.no_grad():
            if swapper is not None:
                swapper.prepare_forward()
            target = m(x.flip(0), c)
        return (pred - target).pow(2).mean()

    batches = toy_batches(3)
    ref = train(build_toy(), batches, loss_with_target)

    def swapped_run():
        m = build_toy()
        sw = BlockSwapper(list(m.blocks), swap_mask(8, 7), "cpu")
        sw.install()
        return train(m, batches, loss_with_target, sw)

    assert_same_training(ref, swapped_run())

    orig = swap_mod.outer_saved_tensor_hooks_active
    swap_mod.outer_saved_tensor_hooks_active = lambda: True  # as if another hook owned saving
    try:
        broken = swapped_run()
    finally:
        swap_mod.outer_saved_tensor_hooks_active = orig
    assert any(not torch.equal(a, b) for ga, gb in zip(ref[1], broken[1]) for a, b in zip(ga, gb))


def test_two_forwards_one_backward_and_no_grad_eval() -> None:
    def two_passes(m, batch, swapper):
        if swapper is not None:
            swapper.prepare_forward()
        x, c = batch
        return m(x, c).pow(2).mean() + m(x.flip(0), c).abs().mean()

    batches = toy_batches(3)
    for ckpt in (None, "nonreentrant"):
        ref = train(build_toy(ckpt), batches, two_passes)
        m = build_toy(ckpt)
        sw = BlockSwapper(list(m.blocks), swap_mask(8, 6), "cpu", slots_per_shape=3)
        sw.install()
        assert_same_training(ref, train(m, batches, two_passes, sw))
        with torch.no_grad():  # inference through the engine leaves no saved-tensor hooks behind
            sw.prepare_forward()
            m(*batches[0])
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_frozen_params_point_into_slots_while_running() -> None:
    """Independent of the event log: look at the parameters the block actually computes with."""
    m = build_toy()
    sw = BlockSwapper(list(m.blocks), swap_mask(8, 7), "cpu")
    sw.install()
    slot_ptrs = {s.buf.untyped_storage().data_ptr() for p in sw._pools for s in p.slots}
    seen = []

    def check(mod, args):
        ptrs = {p.untyped_storage().data_ptr() for p in mod.parameters() if not p.requires_grad}
        seen.append(ptrs <= slot_ptrs)

    for b in list(m.blocks)[1:]:
        b.register_forward_pre_hook(check)  # registered after the engine's hook: runs after it
    toy_loss(m, toy_batches(1)[0], sw).backward()
    assert seen and all(seen)
    assert sw.resident() and len(sw.resident()) <= sw.stats.slots


def test_cuda_ordering_with_a_fake_stream_api(monkeypatch) -> None:
    """The CUDA branch of the engine, run on CPU tensors against a recording stand-in for
    torch.cuda's streams, events and cudart: checks the event protocol the GPU relies on and that
    the step never synchronizes (a real GPU run is in the gpu-marked tests)."""
    fake = FakeCuda()
    fake.install(monkeypatch)
    log, compute = fake.log, fake.compute

    batches = toy_batches(3)
    for ckpt in (None, "nonreentrant"):
        log.clear()
        ref = train(build_toy(ckpt, fp8=True), batches, toy_loss)
        m = build_toy(ckpt, fp8=True)
        sw = BlockSwapper(list(m.blocks), swap_mask(8, 7), "cpu", record_events=True)
        sw._cuda = True  # take the CUDA code path; tensors stay on the CPU
        sw.install()
        assert sw.stats.pinned and len(fake.registered) == 7
        slot_events = {id(s.ready): s for p in sw._pools for s in p.slots}

        class Tee(list):
            def append(self, item):
                super().append(item)
                log.append(item)

        sw._events = Tee()
        log.clear()
        got = train(m, batches, toy_loss, sw)
        assert_same_training(ref, got)
        assert ("synchronize",) not in log and not any(e[0] == "wait_stream" for e in log)

        where: dict[int, object] = {}  # block -> slot of its latest load
        last_ready: dict[int, int] = {}  # id(ready event) -> log position of its latest record
        for pos, e in enumerate(log):
            if isinstance(e, SwapEvent) and e.kind == "load":
                # free.record(compute) -> copy.wait_event(free) -> [copy] -> ready.record(copy) -> log
                rec_free, wait_free, rec_ready = log[pos - 3], log[pos - 2], log[pos - 1]
                assert rec_free[0] == "record" and rec_free[2] is compute
                assert wait_free == ("wait", wait_free[1], rec_free[1]) and wait_free[1].name == "copy"
                assert rec_ready[0] == "record" and rec_ready[2] is wait_free[1]
                slot = slot_events[id(rec_ready[1])]
                assert rec_free[1] is slot.free
                where[e.block] = slot
                last_ready[id(slot.ready)] = pos - 1
            elif isinstance(e, SwapEvent) and e.kind == "run":
                # the compute stream waited on the ready event of the block's slot, after its copy
                waited = log[pos - 1]
                assert waited[0] == "wait" and waited[1] is compute, (pos, e)
                assert waited[2] is where[e.block].ready
                assert last_ready[id(waited[2])] < pos - 1
        copy_stream = sw._copy_stream
        sw.remove()  # waits for in-flight copies, then synchronizes once and unpins everything
        assert ("wait_stream", compute, copy_stream) in log
        assert ("synchronize",) in log and not fake.registered


def test_fake_cuda_register_failure_falls_back(monkeypatch, caplog) -> None:
    fake = FakeCuda(register_rc=3)  # e.g. a low locked-memory limit in a container
    fake.install(monkeypatch)
    batches = toy_batches(2)
    ref = train(build_toy(), batches, toy_loss)
    m = build_toy()
    sw = BlockSwapper(list(m.blocks), swap_mask(8, 7), "cpu")
    sw._cuda = True
    with caplog.at_level(logging.WARNING, logger="imglora.memory.swap"):
        sw.install()
    # falls back to PyTorch's pinned allocator, or (a CPU-only torch) to pageable memory
    assert sw.stats.pinned == torch.cuda.is_available() and not fake.registered
    assert len([r for r in caplog.records if "cudaHostRegister failed (3)" in r.getMessage()]) == 1
    assert_same_training(ref, train(m, batches, toy_loss, sw))
    sw.remove()


def test_cpu_warns_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(swap_mod, "_warned_cpu", False)
    with caplog.at_level(logging.WARNING, logger="imglora.memory.swap"):
        BlockSwapper(list(build_toy().blocks), swap_mask(8, 2), "cpu").install()
        BlockSwapper(list(build_toy().blocks), swap_mask(8, 2), "cpu").install()
    msgs = [r.getMessage() for r in caplog.records if "no GPU memory is saved" in r.getMessage()]
    assert len(msgs) == 1


def test_bad_arguments() -> None:
    blocks = list(build_toy().blocks)
    with pytest.raises(ValueError, match="swap mask has 3 entries for 8 blocks"):
        BlockSwapper(blocks, [True] * 3, "cpu")
    with pytest.raises(ValueError, match=r"swap indices \[8\] out of range"):
        BlockSwapper(blocks, {1, 8}, "cpu")
    with pytest.raises(ValueError, match="slots_per_shape must be >= 1"):
        BlockSwapper(blocks, {1}, "cpu", slots_per_shape=0)
    with pytest.raises(ValueError, match="appears twice"):
        BlockSwapper([blocks[0], blocks[0]], {1}, "cpu")
    blocks[2].fc1.base_layer.weight = blocks[1].fc1.base_layer.weight  # tied across blocks
    with pytest.raises(ValueError, match="shared with block 1"):
        BlockSwapper(blocks, {2}, "cpu").install()
    ok = BlockSwapper(list(build_toy().blocks), {7}, "cpu")
    ok.install()
    with pytest.raises(RuntimeError, match="called twice"):
        ok.install()
    ok.remove()
    ok.install()  # install again after remove
    ok.remove()


def test_kohya_split() -> None:
    assert kohya_split(18, 19, 38) == (9, 18)
    assert kohya_split(0, 19, 38) == (0, 0)
    assert kohya_split(1, 19, 38) == (0, 2)
    assert kohya_split(38, 19, 38) == (19, 38)
    with pytest.raises(ValueError, match=r"swapping 39 blocks means 19 double and 40 single.*largest valid number is 38"):
        kohya_split(39, 19, 38)
    with pytest.raises(ValueError, match=">= 0"):
        kohya_split(-1, 19, 38)
    with pytest.raises(TypeError):
        kohya_split(2.0, 19, 38)  # type: ignore[arg-type]


def test_swap_mask_takes_the_last_blocks() -> None:
    assert swap_mask(5, 2) == [False, False, False, True, True]
    assert swap_mask(3, 0) == [False] * 3
    assert swap_mask(3, 3) == [True] * 3
    with pytest.raises(ValueError, match="cannot swap 4 of 3 blocks"):
        swap_mask(3, 4)


# ------------------------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize("ckpt", [None, "nonreentrant"])
def test_cuda_swap_matches_no_swap(ckpt, fp8) -> None:
    batches = toy_batches(3, "cuda")
    stats = run_equivalence(
        lambda: build_toy(ckpt, fp8),
        batches,
        toy_loss,
        lambda m: (list(m.blocks), swap_mask(8, 7)),
        ckpt,
        device="cuda",
    )
    assert stats.pinned and stats.d2h_bytes == 0


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_cuda_flux_swap_matches_no_swap(fp8) -> None:
    run_equivalence(lambda: build_flux(True, fp8), flux_batches(3, "cuda"), flux_loss, flux_blocks, True, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("ckpt", [None, "nonreentrant"])
def test_cuda_peak_memory_drops_by_the_swapped_weights(ckpt) -> None:
    """16 blocks of ~34 MB (fp32), 14 swapped through 2 slots: the peak must drop by at least 80%
    of the swapped blocks' bytes (ideal: 12/14 = 86%; the rest is the two slots)."""
    from imglora.memory import weight_bytes

    dim = 1024

    def build():
        torch.manual_seed(0)
        m = Toy(ckpt, dim=dim)
        m.blocks = nn.ModuleList([Block(dim, 4 * dim) for _ in range(16)])
        m.requires_grad_(False)
        add_lora(m, ["fc1", "fc2"])
        return m

    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(2, 64, dim, generator=g).cuda(), torch.randn(2, 1, dim, generator=g).cuda())

    def peak(swap: bool) -> tuple[int, int]:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        m = build()
        sw = None
        swapped = 0
        if swap:
            mask = swap_mask(16, 14)
            swapped = sum(weight_bytes(b) for b, s in zip(m.blocks, mask) if s)
            swapped -= sum(p.numel() * p.element_size() for b, s in zip(m.blocks, mask) if s for p in b.parameters() if p.requires_grad)
            sw = BlockSwapper(list(m.blocks), mask, "cuda")
            sw.install()
            assert sw.stats.pinned
        else:
            to_device(m, "cuda")
        train(m, [batch, batch], toy_loss, sw)
        torch.cuda.synchronize()
        result = torch.cuda.max_memory_allocated() - base, swapped
        if sw is not None:
            assert sw.stats.d2h_bytes == 0
            sw.remove()
        del m, sw
        return result

    no_swap, _ = peak(False)
    with_swap, swapped = peak(True)
    assert no_swap - with_swap >= 0.8 * swapped, (no_swap, with_swap, swapped)

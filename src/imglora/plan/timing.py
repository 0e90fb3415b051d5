"""``imglora plan``'s seconds per optimizer update: the kernels of one step, priced on a device.

The kernels come from the meta-device step the memory plan already runs (``memory.op_count``):
every product with its FLOPs and dtype, every memory-bound op with the bytes it moves, forward and
backward, block by block. A setting changes them as the code does: with ``fp8`` every product with
a quantized base weight first dequantizes it (quanto: a cast and a scale multiply, then the bf16
product, the bias added apart), in forward, recompute and the input gradient alike; with ``fp8f``
they run through ``memory.fp8_fused.DequantMatmul`` (one cast, one scaling pass on the weight or
the output, whichever is smaller, the bias fused), with ``fp8c`` through
``memory.fp8_compute._ScaledMatmul`` (rows quantized per token, the product on fp8 tensor cores;
the fused path where a shape does not fit): the kernels of both are counted by running that code on
the meta device. Each kernel takes ``max(FLOPs / (peak x efficiency), bytes / (bandwidth x
efficiency))`` and at least one launch; on a GPU the host's dispatching overlaps the device's work, on the CPU it adds.

Swapped blocks are simulated pass by pass as the swap engine schedules them: a block's weights come
over the host link into one of ``prefetch + 1`` slots while earlier blocks compute, and a block
starts when both its copy and the block before it are done; checkpoint boundaries (offloaded) come
back over the same link in backward. The optimizer step is torch's AdamW on the adapter's tensors,
run on the meta device too.

Peaks are datasheet figures (dense, no sparsity; fp32 accumulation, which PyTorch uses). The
efficiencies are assumptions, stated per device; ``--bench`` replaces the prediction with what
``imglora bench-swap`` measured. On the CPU the device is measured: a few seconds of matmuls,
attention, copies and small ops (:func:`calibrate_cpu`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .op_count import ATTENTION, BACKWARD, BASE, FORWARD, OTHER, Op, OpCounter, OpTally

GB = 1e9


@dataclass(frozen=True)
class Device:
    name: str
    label: str
    tflops: dict[str, float]  # dense product peaks by dtype ("fp32", "bf16", "fp16", "fp8"; absent: none)
    memory_gbs: float  # device memory bandwidth
    link_gbs: float  # host <-> device, one direction (PCIe)
    vram_gib: float | None  # what the card reports (nvidia-smi's total), for "fits"
    capability: tuple[int, int] | None
    matmul_eff: float = 0.70  # of the product peak, large products
    attention_eff: tuple[float, float] = (0.35, 0.28)  # forward, backward: FlashAttention-2 through SDPA
    memory_eff: float = 0.80
    product_gbs: float | None = None  # the traffic a product streams at when its arithmetic is light (None: memory's)
    fp8_convert_gbs: float | None = None  # bytes/s of a cast from fp8 (None: memory's)
    link_eff: float = 0.80
    launch_s: float = 2.5e-6  # the least time a kernel takes on the device
    host_op_s: tuple[float, float] = (8e-6, 4e-6)  # host time to dispatch one op: forward (Python), backward
    quanto_call_s: tuple[float, float] = (40e-6, 40e-6)  # host time of an fp8 (quanto) Linear call beyond its ops
    asynchronous: bool = True  # the host runs ahead of the device (a GPU); on the CPU the two add
    measured: bool = False  # the figures were measured on this machine (calibrate_cpu)

    def peak(self, dtype: torch.dtype | str) -> float | None:
        key = dtype if isinstance(dtype, str) else {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
        t = self.tflops.get(key)
        return None if t is None else t * 1e12

    @property
    def has_fp8(self) -> bool:
        return "fp8" in self.tflops


_HOPPER = dict(matmul_eff=0.70, attention_eff=(0.35, 0.28))
_AMPERE_ADA = dict(matmul_eff=0.75, attention_eff=(0.60, 0.45))
# Datasheet peaks (NVIDIA): dense tensor-core TFLOPS with fp32 accumulation; fp32 without TF32
# (PyTorch's default for fp32 products); HBM/GDDR bandwidth; PCIe per direction (Gen4 x16 32 GB/s,
# Gen5 x16 64 GB/s); memory as nvidia-smi reports it.
GPUS: dict[str, Device] = {d.name: d for d in [
    Device("h200", "H200 SXM (141 GB HBM3e)", {"bf16": 989.5, "fp16": 989.5, "fp8": 1979.0, "fp32": 66.9},
           4800, 64, 139.8, (9, 0), **_HOPPER),
    Device("h100", "H100 SXM (80 GB HBM3)", {"bf16": 989.5, "fp16": 989.5, "fp8": 1979.0, "fp32": 66.9},
           3350, 64, 79.6, (9, 0), **_HOPPER),
    Device("h100-pcie", "H100 PCIe (80 GB HBM2e)", {"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "fp32": 51.2},
           2000, 64, 79.6, (9, 0), **_HOPPER),
    Device("a100", "A100 SXM (80 GB HBM2e)", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
           2039, 32, 79.2, (8, 0), **_AMPERE_ADA),
    Device("l40s", "L40S (48 GB GDDR6)", {"bf16": 362.0, "fp16": 362.0, "fp8": 733.0, "fp32": 91.6},
           864, 32, 44.5, (8, 9), **_AMPERE_ADA),
    Device("3090", "GeForce RTX 3090 (24 GB GDDR6X)", {"bf16": 71.0, "fp16": 71.0, "fp32": 35.6},
           936, 32, 24.0, (8, 6), **_AMPERE_ADA),
    Device("4090", "GeForce RTX 4090 (24 GB GDDR6X)", {"bf16": 165.2, "fp16": 165.2, "fp8": 330.3, "fp32": 82.6},
           1008, 32, 23.6, (8, 9), **_AMPERE_ADA),
    Device("5090", "GeForce RTX 5090 (32 GB GDDR7)", {"bf16": 209.5, "fp16": 209.5, "fp8": 419.0, "fp32": 104.8},
           1792, 64, 31.4, (12, 0), **_AMPERE_ADA),
]}


def gpu(name: str) -> Device:
    from ..errors import ImgloraError

    key = name.lower().removeprefix("rtx").removeprefix("-").strip()
    if key not in GPUS:
        raise ImgloraError(f"--gpu {name!r}: not a GPU imglora knows; use one of {', '.join(GPUS)}")
    return GPUS[key]


# ----------------------------------------------------------------------------------------------
# The CPU, measured


_CPU: Device | None = None


def calibrate_cpu() -> Device:
    """This machine's CPU as a :class:`Device`: product rates (fp32, bf16; and the traffic of a
    product with few rows, which streams its weight), attention's rate (the CPU flash kernel), copy
    bandwidth, the speed of a cast from fp8, and the time of one eager op beyond its work (forward and
    backward), each the best of a few runs of a microbenchmark (about two seconds). Cached per process."""
    global _CPU
    if _CPU is not None:
        return _CPU

    def best(fn: Any, n: int = 5) -> float:
        fn()
        out = math.inf
        for _ in range(n):
            t = time.perf_counter()
            fn()
            out = min(out, time.perf_counter() - t)
        return out

    m = 512
    rates: dict[str, float] = {}
    for key, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(m, m, dtype=dt), torch.randn(m, m, dtype=dt)
        rates[key] = 2 * m**3 / best(lambda: torch.mm(a, b)) / 1e12
    q = torch.randn(1, 4, 256, 64)
    attn = 4 * 4 * 256 * 256 * 64 / best(lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, q, q, 0.0, False)) / 1e12
    x = torch.randn(8 * 2**20)
    y = torch.empty_like(x)
    gbs = 2 * x.numel() * 4 / best(lambda: y.copy_(x)) / GB  # a copy reads and writes
    w = torch.randn(4096, 1024)
    a = torch.randn(32, 1024)
    product_gbs = 4 * (w.numel() + a.numel() + 32 * 4096) / best(lambda: torch.mm(a, w.t())) / GB
    w8 = w.to(torch.float8_e4m3fn)
    fp8_gbs = 5 * w.numel() / best(lambda: w8.to(torch.float32)) / GB  # reads 1 byte, writes 4
    fwd_op, bwd_op = _eager_op_seconds(best)
    quanto = _quanto_call_seconds(best, (fwd_op, bwd_op))
    _CPU = Device("cpu", f"this CPU ({torch.get_num_threads()} threads, measured)", rates, gbs, gbs / 2, None, None,
                  matmul_eff=1.0, attention_eff=(attn / rates["fp32"], attn / rates["fp32"]), memory_eff=1.0,
                  product_gbs=product_gbs, fp8_convert_gbs=fp8_gbs,
                  link_eff=1.0, launch_s=0.0, host_op_s=(fwd_op, bwd_op), quanto_call_s=quanto, asynchronous=False, measured=True)
    return _CPU


class _Block(torch.nn.Module):
    """A transformer block of plain torch modules (norm, q/k/v, attention, output, MLP), the shape
    of a diffusion transformer's, at a width where arithmetic is negligible."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)
        self.act = torch.nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, n, 2, d // 2).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.o(a)
        return x + self.down(self.act(self.up(self.norm2(x))))


def _timed_step(module: torch.nn.Module, forward: Any, best: Any) -> tuple[float, float, int, int]:
    """(forward seconds, forward + backward seconds, forward ops, backward ops) of ``forward()``
    (a scalar) and its backward, each the best of 20 runs; the ops counted once."""
    def step() -> None:
        forward().backward()

    with OpCounter(module, [], recompute_tags=False) as c:
        step()
    n_fwd = sum(1 for o in c.tally.ops if o.phase == FORWARD)
    return best(forward, 20), best(step, 20), n_fwd, len(c.tally.ops) - n_fwd


def _eager_op_seconds(best: Any) -> tuple[float, float]:
    """Seconds of one op of eager PyTorch beyond its work, forward (module calls, autograd
    recording) and backward (the autograd engine), on a stack of tiny transformer blocks under
    gradient checkpointing whose arithmetic is negligible."""
    from torch.utils.checkpoint import checkpoint

    net = torch.nn.ModuleList(_Block() for _ in range(4)).requires_grad_(False)
    for blk in net:
        for lin in (blk.q, blk.k, blk.v, blk.o):
            lin.weight.requires_grad_(True)  # (stands for an adapter: gradients flow through every block)
    x = torch.randn(1, 8, 16, requires_grad=True)

    def forward() -> torch.Tensor:
        h = x
        for blk in net:
            h = checkpoint(blk, h, use_reentrant=False)
        return h.sum()

    fwd, both, n_fwd, n_bwd = _timed_step(net, forward, best)
    return fwd / n_fwd, max(both - fwd, 0.0) / max(n_bwd, 1)


def _quanto_call_seconds(best: Any, per_op: tuple[float, float]) -> tuple[float, float]:
    """Host seconds an fp8 (quanto) Linear call costs beyond its kernels, forward and input
    gradient: its tensor subclass dispatching in Python."""
    try:
        from optimum.quanto import freeze, qfloat8, quantize
    except ImportError:
        return 0.0, 0.0
    layers = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(16))).requires_grad_(False)
    quantize(layers, weights=qfloat8)
    freeze(layers)
    x = torch.randn(4, 16, requires_grad=True)

    def forward() -> torch.Tensor:
        return layers(x).sum()

    fwd, both, n_fwd, n_bwd = _timed_step(layers, forward, best)
    return (max(0.0, fwd - n_fwd * per_op[0]) / 16, max(0.0, both - fwd - n_bwd * per_op[1]) / 16)


# ----------------------------------------------------------------------------------------------
# A setting's kernels


@dataclass(frozen=True)
class Variant:
    """What a setting changes in the kernels and copies."""

    quantized: frozenset[str] = frozenset()  # base layers stored in fp8
    fp8_compute: bool = False
    swapped: dict[str, int] = field(default_factory=dict)  # block -> bytes it brings over the link per visit
    boundaries: tuple[int, ...] = ()  # offloaded checkpoint inputs, per checkpointed block (forward order)
    prefetch: int = 1
    fused: bool = False  # memory.fp8_fused: the dequantizing matmul of memory/fp8_fused.py (fp8c's fallback too)


def _meta_ops(fn: Any) -> list[Op]:
    with OpCounter(torch.nn.Module(), [], recompute_tags=False) as c:
        fn()
    return c.tally.ops


_PRICED: dict[tuple, list[Op]] = {}


def _replacement(op: Op, compute_fp8: bool, cuda: bool, fused: bool = False) -> list[Op]:
    """The kernels a product with a quantized base weight becomes (module docstring), keyed by shape."""
    rows, inp, out = op.shape
    forward = op.role == "fwd"
    from ..memory.fp8_compute import _fits

    fp8c = compute_fp8 and _fits(rows, inp, out)
    fused = fused or compute_fp8  # fp8 compute falls back to the fused path
    key = (rows, inp, out, forward, op.bias, op.dtype, fp8c, fused and not fp8c, cuda)
    if key not in _PRICED:
        meta = torch.device("meta")
        data = torch.empty(out, inp, dtype=torch.float8_e4m3fn, device=meta)
        scale = torch.empty(out, 1, dtype=op.dtype, device=meta)
        if fp8c:
            from ..memory.fp8_compute import _ScaledMatmul

            x = torch.empty(rows, inp, dtype=op.dtype, device=meta, requires_grad=not forward)
            bias = torch.empty(out, dtype=op.dtype, device=meta) if op.bias else None
            if forward:
                ops = _meta_ops(lambda: _ScaledMatmul.forward(_Ctx(), x, data, scale, bias, op.dtype))
            else:
                ctx = _Ctx(saved=(data, scale), x_dtype=op.dtype, x_shape=(rows, inp))
                g = torch.empty(rows, out, dtype=op.dtype, device=meta)
                ops = _meta_ops(lambda: _ScaledMatmul.backward(ctx, g))
        elif fused:
            from ..memory.fp8_fused import DequantMatmul

            x = torch.empty(rows, inp, dtype=op.dtype, device=meta)
            bias = torch.empty(out, dtype=op.dtype, device=meta) if op.bias else None
            if forward:
                ops = _meta_ops(lambda: DequantMatmul.forward(_Ctx(), x, data, scale, bias, op.dtype))
            else:
                ctx = _Ctx(saved=(data, scale), x_dtype=op.dtype, dtype=op.dtype, bias_dtype=op.dtype,
                           needs_input_grad=(True, False, False, False, False))
                g = torch.empty(rows, out, dtype=op.dtype, device=meta)
                ops = _meta_ops(lambda: DequantMatmul.backward(ctx, g))
        else:  # quanto's qbytes_mm: the weight cast and scaled, then the product; the bias apart
            def dequantizing() -> None:
                w = scale * data.to(op.dtype)
                if forward:
                    y = torch.matmul(torch.empty(rows, inp, dtype=op.dtype, device=meta), w.t())
                    if op.bias:
                        y + torch.empty(out, dtype=op.dtype, device=meta)
                else:
                    torch.matmul(torch.empty(rows, out, dtype=op.dtype, device=meta), w)
            ops = _meta_ops(dequantizing)
        _PRICED[key] = ops
    return [replace(o, phase=op.phase, block=op.block) for o in _PRICED[key]]


class _Ctx:
    def __init__(self, saved: tuple = (), **kw: Any) -> None:
        self.saved_tensors = saved
        self.__dict__.update(kw)

    def save_for_backward(self, *t: Any) -> None:
        self.saved_tensors = t


def kernels(tally: OpTally, v: Variant, cuda: bool) -> list[Op]:
    out: list[Op] = []
    for op in tally.ops:
        if op.kind == BASE and op.layer in v.quantized:
            out += _replacement(op, v.fp8_compute, cuda, v.fused)
        else:
            out.append(op)
    return out


# ----------------------------------------------------------------------------------------------
# Seconds


def op_seconds(op: Op, dev: Device) -> float:
    gbs = dev.memory_gbs * dev.memory_eff
    if op.flops and dev.product_gbs:
        gbs = dev.product_gbs
    elif op.from_fp8 and not op.flops and dev.fp8_convert_gbs:
        gbs = dev.fp8_convert_gbs
    byte_s = op.bytes / (gbs * GB)
    if not op.flops:
        return max(byte_s, dev.launch_s)
    if op.fp8:
        peak = dev.peak("fp8") or dev.peak(torch.bfloat16)  # (a CPU runs it at its bf16 rate, or so)
    else:
        peak = dev.peak(op.dtype)
    assert peak is not None
    eff = dev.attention_eff[op.phase] if op.kind == ATTENTION else dev.matmul_eff
    return max(op.flops / (peak * eff), byte_s, dev.launch_s)


@dataclass
class Estimate:
    seconds: float
    parts: dict[str, float]  # what the seconds are made of (they add up to ``seconds``)
    device: str
    kernels: int

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "parts": self.parts, "device": self.device, "kernels": self.kernels}


def _pass(order: list[int], compute: dict[int, float], copy: dict[int, float], pre: float, post: float,
          slots: int) -> tuple[float, float]:
    """(wall seconds, seconds compute waited for copies) of one pass over the blocks in ``order``:
    ``pre`` before the first block, ``post`` after the last. The swapped blocks' copies run one at a
    time on the link from the pass's start; a copy can start once its slot is free (the block
    ``slots`` swapped blocks earlier has computed); a block starts when its copy has arrived and
    the block before it is done."""
    swapped = [b for b in order if copy.get(b)]
    index = {b: j for j, b in enumerate(swapped)}
    arrive: dict[int, float] = {}
    end: dict[int, float] = {}
    link = waited = 0.0
    t = pre
    issued = 0
    for b in order:
        while issued < len(swapped) and (issued < slots or issued - slots in end):
            free = end[issued - slots] if issued >= slots else 0.0
            link = arrive[issued] = max(link, free) + copy[swapped[issued]]
            issued += 1
        if b in index and arrive[index[b]] > t:
            waited += arrive[index[b]] - t
            t = arrive[index[b]]
        t += compute.get(b, 0.0)
        if b in index:
            end[index[b]] = t
    return t + post, waited


def estimate(tally: OpTally, v: Variant, dev: Device, optimizer: list[Op] | None = None) -> Estimate:
    """Seconds of one optimizer update (one micro-batch) on ``dev`` (module docstring)."""
    ops = kernels(tally, v, dev.asynchronous)
    block_s: list[dict[int, float]] = [{}, {}]  # per phase: block -> device seconds
    edge = [[0.0, 0.0], [0.0, 0.0]]  # per phase: outside the blocks, before the first block op / after
    host = [0.0, 0.0]
    first: dict[int, int] = {}
    seen = [False, False]
    by_kind = {"products": 0.0, "attention": 0.0, "memory-bound": 0.0}
    for op in tally.ops:  # each use of a quanto fp8 layer: its Python dispatching on the host
        if op.kind == BASE and op.layer in v.quantized and not (v.fp8_compute or v.fused):
            host[op.phase] += dev.quanto_call_s[0 if op.role == "fwd" else 1]
    for i, op in enumerate(ops):
        s = op_seconds(op, dev)
        host[op.phase] += dev.host_op_s[op.phase]
        by_kind["attention" if op.kind == ATTENTION else "products" if op.flops else "memory-bound"] += s
        if op.block >= 0:
            first.setdefault(op.block, i)
            seen[op.phase] = True
            block_s[op.phase][op.block] = block_s[op.phase].get(op.block, 0.0) + s
        else:
            edge[op.phase][1 if seen[op.phase] else 0] += s
    order = sorted(first, key=first.__getitem__)
    if order and not block_s[BACKWARD]:
        # backward not tagged by block (no gradient checkpointing): split it as forward is split
        fwd_total = sum(block_s[FORWARD].values()) + sum(edge[FORWARD])
        bwd_total = sum(edge[BACKWARD])
        share = bwd_total / fwd_total if fwd_total else 0.0
        block_s[BACKWARD] = {b: s * share for b, s in block_s[FORWARD].items()}
        edge[BACKWARD] = [edge[FORWARD][1] * share, edge[FORWARD][0] * share]
    link = dev.link_gbs * GB * dev.link_eff
    copy = {b: v.swapped.get(tally.blocks[b], 0) / link for b in order}
    back_copy = dict(copy)
    if v.boundaries and len(v.boundaries) == len(order):
        for b, n in zip(order, v.boundaries):
            back_copy[b] += n / link
    slots = max(1, v.prefetch) + 1
    compute = [sum(block_s[p].values()) + sum(edge[p]) for p in (FORWARD, BACKWARD)]
    if dev.asynchronous:
        _, wait_f = _pass(order, block_s[FORWARD], copy, edge[FORWARD][0], edge[FORWARD][1], slots)
        _, wait_b = _pass(order[::-1], block_s[BACKWARD], back_copy, edge[BACKWARD][0], edge[BACKWARD][1], slots)
    else:  # one thread: every copy (host to host) and every dispatch adds
        wait_f, wait_b = sum(copy.values()), sum(back_copy.values())
    opt_s = sum(op_seconds(o, dev) for o in optimizer or [])
    opt_host = len(optimizer or []) * dev.host_op_s[BACKWARD]
    if dev.asynchronous:  # the host dispatches ahead of the device: the slower of the two sets the pace
        dispatch = sum(max(0.0, h - c) for h, c in zip(host + [opt_host], compute + [opt_s]))
    else:
        dispatch = host[0] + host[1] + opt_host
    parts = {**by_kind, "optimizer": opt_s, "dispatch": dispatch, "waiting for copies": wait_f + wait_b}
    return Estimate(sum(parts.values()), parts, dev.name, len(ops) + len(optimizer or []))


def optimizer_ops(params: list[tuple[str, int, tuple[int, ...]]], cuda: bool, clip: bool = True) -> list[Op]:
    """The kernels of torch's AdamW step (foreach on CUDA, per tensor on the CPU) and gradient
    clipping over the adapter's fp32 tensors, counted on the meta device."""
    meta = torch.device("meta")
    ps = [torch.nn.Parameter(torch.empty(s, device=meta)) for _, _, s in params]
    for p in ps:
        p.grad = torch.empty_like(p)
    opt = torch.optim.AdamW(ps, lr=1e-4, foreach=cuda)

    def step() -> None:
        if clip:
            norms = [torch.linalg.vector_norm(p.grad) for p in ps]
            total = torch.linalg.vector_norm(torch.stack(norms)) if norms else None
            if total is not None:
                coef = torch.clamp(1.0 / (total + 1e-6), max=1.0)
                if cuda:
                    torch._foreach_mul_([p.grad for p in ps], coef)
                else:
                    for p in ps:
                        p.grad.mul_(coef)
        opt.step()

    ops = _meta_ops(step)
    if cuda and clip:  # the foreach norm is one kernel per chunk; the per-tensor norms above stand in
        ops = ops[len(ps):]
        ops.insert(0, Op(OTHER, BACKWARD, -1, torch.float32, 0, 4 * sum(k for _, k, _ in params)))
    return [replace(o, phase=BACKWARD, block=-1) for o in ops]

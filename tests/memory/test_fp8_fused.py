"""memory.fp8_fused: the dequantizing fp8 matmul without work done twice (memory/fp8_fused.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_swap import build_flux, flux_batches, flux_loss, train
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from imglora.memory import quantize_fp8
from imglora.memory.fp8_fused import enable, fused_linear


def layer(dtype: torch.dtype, inp: int = 512, out: int = 384, bias: bool = True, weight_scale: float = 4.0):
    torch.manual_seed(3)
    dense = nn.Linear(inp, out, bias=bias).to(dtype)
    with torch.no_grad():
        dense.weight.mul_(weight_scale)
        if bias:
            dense.bias.normal_(0, 0.5)
    dense.requires_grad_(False)
    wrapper = nn.Sequential(dense)
    quantize_fp8(wrapper)
    return wrapper


def exact(q: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output and input gradient in float64 from the same fp8 weights and scales."""
    w = q.weight._data.double() * q.weight._scale.double()
    b = q.bias.double() if q.bias is not None else 0
    return x.double() @ w.t() + b, g.double() @ w


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.double()).norm() / b.double().norm())


def run(q: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    y = q(x)
    (gx,) = torch.autograd.grad(y, x, g)
    return y.detach(), gx


@pytest.mark.parametrize("tokens", [32, 128])  # 256 rows < 512 inputs: scales on the output; 1024 rows: on the weight
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_and_input_gradient_as_accurate_as_quantos(dtype, tokens) -> None:
    """Against the float64 product of the same fp8 weights: in fp32 to fp32 rounding; in bf16 the
    fused path rounds twice (the product and the scaling, or the scaled weight and the product) as
    quanto does, so both stay within twice bf16's own rounding of the exact result (measured on a
    3072-wide layer, scales on the output: fused 1.4x, quanto 1.7x)."""
    wrapper = layer(dtype)
    q = wrapper[0]
    x = (torch.randn(8, tokens, 512) * 3).to(dtype)
    g = torch.randn(8, tokens, 384).to(dtype)
    ref_y, ref_gx = exact(q, x, g)
    y0, gx0 = run(q, x, g)  # quanto
    assert enable(wrapper) == 1
    y1, gx1 = run(q, x, g)
    assert y1.dtype == gx1.dtype == dtype and y1.shape == y0.shape
    if dtype == torch.float32:
        assert rel(y1, ref_y) < 1e-6 and rel(gx1, ref_gx) < 1e-6
    else:
        floor_y, floor_g = rel(ref_y.to(dtype), ref_y), rel(ref_gx.to(dtype), ref_gx)
        assert rel(y1, ref_y) <= 2 * floor_y and rel(gx1, ref_gx) <= 2 * floor_g, (rel(y1, ref_y), floor_y)
        assert rel(y0, ref_y) <= 2 * floor_y  # quanto, for comparison
    assert not torch.equal(y1, y0)  # it really ran another path


def test_fp16_scales_the_weight_first_so_the_product_cannot_overflow() -> None:
    """In fp16 the unscaled product of the fp8 values (up to 448) would overflow; the scales are
    applied to the weight before the product there."""
    wrapper = layer(torch.float16, weight_scale=1e-2)
    q = wrapper[0]
    x = (torch.randn(4, 16, 512) * 200).half()
    g = torch.randn(4, 16, 384).half()
    unscaled = x.float() @ q.weight._data.float().t()
    assert float(unscaled.abs().max()) > torch.finfo(torch.float16).max  # the danger is real
    ref_y, ref_gx = exact(q, x, g)
    enable(wrapper)
    y, gx = run(q, x, g)
    assert torch.isfinite(y).all() and torch.isfinite(gx).all()
    assert rel(y, ref_y) < 3e-3 and rel(gx, ref_gx) < 3e-3  # fp16: 11 bits, 2**-11 half ulp per rounding


class Ops(TorchDispatchMode):
    """Every aten op that writes a tensor (views left out), with its output's shape and dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and not func.is_view:
            self.ops.append((str(func.overloadpacket.__name__), tuple(out.shape), out.dtype))
        return out


def weight_sized(ops: list, shape: tuple[int, int]) -> list:
    return [o for o in ops if o[1] in (shape, shape[::-1])]


def test_one_weight_sized_pass_per_use_and_no_fp32_weight_under_autocast() -> None:
    """A model loaded in fp32 (fp32 scales) under bf16 autocast: quanto's product is its own op,
    which autocast does not cast, so it dequantizes and multiplies in fp32 whatever autocast asks;
    the fused path makes one weight-sized tensor per use, in bf16, forward and backward alike, and
    adds the bias in the same pass as the scales."""
    wrapper = layer(torch.float32)
    q = wrapper[0]
    shape = tuple(q.weight.shape)
    x = torch.randn(64, 512, requires_grad=True)

    def traced() -> list:
        with Ops() as ops, torch.autocast("cpu", dtype=torch.bfloat16):
            y = q(x)
        fwd = list(ops.ops)
        with Ops() as ops:
            y.backward(torch.ones_like(y))
        return fwd, ops.ops

    fwd0, bwd0 = traced()
    assert [o[2] for o in fwd0 if o[0] == "qbytes_mm"] == [torch.float32]
    enable(wrapper)
    fwd, bwd = traced()
    assert [o[2] for o in weight_sized(fwd, shape)] == [torch.bfloat16]
    assert [o[2] for o in weight_sized(bwd, shape)] == [torch.bfloat16]
    out_sized = [o for o in fwd if o[1] == (64, 384)]
    assert [o[0] for o in out_sized] == ["mm", "addcmul"] and out_sized[-1][2] == torch.bfloat16
    tall = torch.randn(1024, 512, requires_grad=True)  # more rows than inputs: scaled on the weight instead
    with Ops() as ops, torch.autocast("cpu", dtype=torch.bfloat16):
        q(tall)
    assert [o[0] for o in weight_sized(ops.ops, shape)] == ["_to_copy", "mul_"]
    assert [o[0] for o in ops.ops if o[1] == (1024, 384)] == ["addmm"]  # the bias added by the product


def test_the_input_is_not_saved_for_a_weight_gradient_never_computed() -> None:
    """quanto saves the layer's input for backward; the fused path saves only the fp8 weight and
    its scales, which the layer holds anyway."""
    wrapper = layer(torch.float32)
    q = wrapper[0]
    x = torch.randn(64, 512, requires_grad=True)

    def saved() -> list[torch.Tensor]:
        kept: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            q(x).sum().backward()
        return kept

    assert any(t.shape == x.shape for t in saved())  # quanto
    enable(wrapper)
    kept = saved()
    assert sorted((tuple(t.shape), t.dtype) for t in kept) == [((384, 1), torch.float32),
                                                             ((384, 512), torch.float8_e4m3fn)]


def test_a_trainable_bias_gets_its_gradient() -> None:
    wrapper = layer(torch.float32)
    q = wrapper[0]
    q.bias.requires_grad_(True)
    x = torch.randn(2, 8, 512)
    g = torch.randn(2, 8, 384)
    enable(wrapper)
    q(x).backward(g)
    torch.testing.assert_close(q.bias.grad, g.sum((0, 1)), rtol=1e-6, atol=1e-5)


def test_a_layer_without_an_fp8_weight_keeps_its_own_forward() -> None:
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    assert torch.equal(fused_linear(lin, x), lin(x))


def test_tiny_flux_trains_with_the_fused_path_as_with_quantos() -> None:
    """Three AdamW updates of a tiny FLUX with LoRA, fp32 on the CPU: the same math rounded in
    other places, so losses and LoRA gradients agree to float32 rounding's growth over the run."""
    batches = flux_batches(3)
    ref = train(build_flux(ckpt=True, fp8=True), batches, flux_loss)
    model = build_flux(ckpt=True, fp8=True)
    assert enable(model) > 50
    got = train(model, batches, flux_loss)
    for a, b in zip(ref[0], got[0]):
        assert abs(float(b) - float(a)) <= 1e-5 * abs(float(a)), (ref[0], got[0])
    for ga, gb in zip(ref[1], got[1]):
        total_a, total_b = torch.cat([t.flatten() for t in ga]), torch.cat([t.flatten() for t in gb])
        assert rel(total_b, total_a) < 1e-4 and total_b.abs().sum() > 0


def test_apply_memory_installs_it_and_says_so() -> None:
    from imglora.config.schema import MemoryConfig
    from imglora.memory.fp8_fused import _forward
    from imglora.memory.swap import NO_SWAP
    from imglora.memory.wrap import apply_memory

    class Family:
        quantize_exclude = ("x_embedder", "context_embedder", "time_text_embed*", "norm_out*", "proj_out")

    class Cfg:
        memory = replace(MemoryConfig(), fp8=True, fp8_fused=True)

    said: list[str] = []
    model = build_flux()
    setup = apply_memory(model, Family, Cfg, torch.device("cpu"), NO_SWAP, out=said.append)
    n = setup.facts["fp8"]["quantized_layers"]
    assert setup.facts["fp8"]["fused"] is True and n > 50
    assert said[-1] == f"fp8: {n} Linear layers dequantize once per use, scales and bias fused (memory.fp8_fused)"
    from optimum.quanto.nn import QLinear

    fused = [m for m in model.modules() if isinstance(m, QLinear) and getattr(m.forward, "__func__", None) is _forward]
    assert len(fused) == n
    Cfg.memory = replace(MemoryConfig(), fp8=True)
    setup = apply_memory(build_flux(), Family, Cfg, torch.device("cpu"), NO_SWAP, out=said.append)
    assert setup.facts["fp8"]["fused"] is False

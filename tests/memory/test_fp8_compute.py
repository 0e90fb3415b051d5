"""memory.fp8_compute: the frozen fp8 Linear layers' matmuls through torch._scaled_mm (runs on the CPU
in torch 2.13, so the numerics are tested here; the speed is a GPU measurement)."""

from __future__ import annotations

import pytest
import torch
from test_swap import build_flux, flux_batches, flux_loss, train
from torch import nn

from imglora.memory import quantize_fp8
from imglora.memory.fp8_compute import E4M3_MAX, _quantize_rows, enable, supported


def one_layer(bias: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, nn.Module]:
    """A frozen Linear's weight and bias (copies), and the layer quantized to fp8 in a wrapper."""
    torch.manual_seed(3)
    dense = nn.Linear(256, 128, bias=bias)
    with torch.no_grad():
        dense.weight.mul_(4.0)  # weights and activations well away from 1, as in a trained model
        if bias:
            dense.bias.normal_(0, 0.5)
    dense.requires_grad_(False)
    w, b = dense.weight.clone(), dense.bias.clone() if bias else None
    wrapper = nn.Sequential(dense)
    quantize_fp8(wrapper)
    return w, b, wrapper


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_rows_quantize_within_e4m3_resolution() -> None:
    x = torch.randn(32, 64) * torch.logspace(-3, 3, 32).unsqueeze(1)  # rows six decades apart
    q, s = _quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (32, 1)
    top = q.float().abs().amax(dim=1)
    assert float(top.min()) >= E4M3_MAX / 2 and float(top.max()) <= E4M3_MAX  # each row's largest: the top binade
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two: scaling by them is exact
    back = q.float() * s
    # e4m3 keeps 3 mantissa bits: a relative rounding error of at most 2**-4 per element (normal range)
    big = x.abs() > x.abs().amax(dim=1, keepdim=True) * 2**-6
    assert float(((back - x).abs() / x.abs())[big].max()) <= 2**-4 + 1e-6


@pytest.mark.parametrize("bias", [True, False])
def test_one_layer_output_and_input_gradient_within_fp8_error(bias) -> None:
    """Against the dequantizing path (the same fp8 weights, bf16 matmul) and the dense bf16 layer:
    only the activations' and gradients' own fp8 rounding is added (about 2-3 % of the norm for
    e4m3's 3 mantissa bits over random data), and the bias is the layer's."""
    ref_w, ref_b, wrapper = one_layer(bias)
    x = (torch.randn(4, 16, 256) * 3).requires_grad_()
    g = torch.randn(4, 16, 128)
    quant = wrapper[0]

    y0 = quant(x)  # quanto: dequantize, then matmul
    (gx0,) = torch.autograd.grad(y0, x, g)
    state = enable(wrapper)
    assert state.layers == 1
    y1 = quant(x)
    (gx1,) = torch.autograd.grad(y1, x, g)
    assert state.fp8_calls == 1 and state.fallback_calls == 0
    assert y1.shape == y0.shape and y1.dtype == x.dtype
    assert rel(y1, y0) < 0.04 and rel(gx1, gx0) < 0.04  # measured 0.026 and 0.026
    dense_y = x @ ref_w.t() + (ref_b if bias else 0)
    assert rel(y1, dense_y) < 0.05  # measured 0.037 (the dequantizing path alone: 0.025)
    assert rel(y1, y0) > 0  # it really ran another path
    if bias:  # a zero input gives the bias exactly (quantizing zeros is exact)
        zero = torch.zeros(1, 16, 256)
        torch.testing.assert_close(quant(zero), ref_b.expand(1, 16, 128), rtol=0, atol=0)


def test_a_shape_the_kernel_cannot_take_falls_back_to_dequantizing() -> None:
    from imglora.memory.fp8_fused import fused_linear

    _, _, wrapper = one_layer()
    quant = wrapper[0]
    x = torch.randn(3, 256)  # 3 rows: not a multiple of 16
    expected = fused_linear(quant, x)  # the fused dequantizing path (memory/fp8_fused.py)
    state = enable(wrapper)
    got = quant(x)
    assert torch.equal(got, expected)  # the very same path on the same memory
    assert (state.fp8_calls, state.fallback_calls) == (0, 1)


def test_under_bf16_autocast_the_output_is_bf16() -> None:
    _, _, wrapper = one_layer()
    enable(wrapper)
    x = torch.randn(32, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = wrapper[0](x)
    assert y.dtype == torch.bfloat16


def test_tiny_flux_trains_with_fp8_compute_as_with_fp8_storage() -> None:
    """Three AdamW updates of a tiny FLUX with LoRA: fp8 compute stays within fp8's error of the
    fp8-storage run, loss by loss and in the LoRA gradients; the adapters (lora_A, lora_B) get
    gradients through the fp8 path."""
    batches = flux_batches(3, h=4, w=4, txt=16)  # 16 image + 16 text tokens: multiples of 16
    ref = train(build_flux(ckpt=True, fp8=True), batches, flux_loss)
    model = build_flux(ckpt=True, fp8=True)
    state = enable(model)
    got = train(model, batches, flux_loss)
    assert state.layers > 50 and state.fp8_calls > state.fallback_calls > 0  # modulation layers: 2 rows
    for a, b in zip(ref[0], got[0]):
        assert abs(float(b) - float(a)) <= 0.05 * abs(float(a)), (ref[0], got[0])
    for step, (ga, gb) in enumerate(zip(ref[1], got[1])):
        total_a = torch.cat([t.flatten() for t in ga])
        total_b = torch.cat([t.flatten() for t in gb])
        assert rel(total_b, total_a) < 0.1, step
        assert total_b.abs().sum() > 0


def test_supported_refuses_a_gpu_without_fp8_tensor_cores(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    ok, why = supported(torch.device("cuda", 0))
    assert not ok and "compute capability 8.0" in why and "8.9 and newer" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert supported(torch.device("cuda", 0)) == (True, "")
    assert supported(torch.device("cpu")) == (True, "")


def test_supported_refuses_a_cpu_torch_without_row_wise_scales(monkeypatch) -> None:
    # torch 2.11 (the GPU box's) on the CPU: "_scaled_mm only supports per-tensor scaling for CPU
    # backend"; bench-swap's fp8c settings failed there inside the first forward.
    from imglora.memory import fp8_compute

    def per_tensor_only(a, b, *, scale_a, scale_b, **kw):
        if scale_a.numel() != 1 or scale_b.numel() != 1:
            raise RuntimeError("Now _scaled_mm only supports per-tensor scaling for CPU backend.")
        return torch.zeros(a.shape[0], b.shape[1])

    fp8_compute._cpu_rowwise.cache_clear()
    monkeypatch.setattr(torch, "_scaled_mm", per_tensor_only)
    try:
        ok, why = supported(torch.device("cpu"))
        assert not ok and "one scale per tensor" in why and "torch 2.13" in why
    finally:
        fp8_compute._cpu_rowwise.cache_clear()


def test_apply_memory_switches_the_layers_or_says_why_not(monkeypatch) -> None:
    """memory.fp8_compute through apply_memory, as the trainer installs it: on a GPU without fp8
    tensor cores the run says why and keeps dequantizing; where it runs, the fp8 layers switch."""
    from dataclasses import replace

    from imglora.config.schema import MemoryConfig
    from imglora.memory import fp8_compute as mod
    from imglora.memory.swap import NO_SWAP
    from imglora.memory.wrap import apply_memory

    class Family:
        quantize_exclude = ("x_embedder", "context_embedder", "time_text_embed*", "norm_out*", "proj_out")

    class Cfg:
        memory = replace(MemoryConfig(), fp8=True, fp8_compute=True)

    said: list[str] = []
    monkeypatch.setattr(mod, "supported", lambda device: (False, "this GPU (compute capability 8.0) has no fp8"))
    setup = apply_memory(build_flux(), Family, Cfg, torch.device("cpu"), NO_SWAP, out=said.append)
    assert setup.facts["fp8_compute"] == {"enabled": False, "reason": "this GPU (compute capability 8.0) has no fp8"}
    assert said[-1] == ("memory.fp8_compute: this GPU (compute capability 8.0) has no fp8; the fp8 weights are "
                        "dequantized for bf16 matmuls instead")
    monkeypatch.setattr(mod, "supported", lambda device: (True, ""))
    model = build_flux()
    setup = apply_memory(model, Family, Cfg, torch.device("cpu"), NO_SWAP, out=said.append)
    n = setup.facts["fp8_compute"]["layers"]
    assert setup.facts["fp8_compute"]["enabled"] and n == setup.facts["fp8"]["quantized_layers"] > 50
    assert said[-1] == f"fp8 compute: {n} Linear layers multiply in fp8 (torch._scaled_mm)"


def test_fp8_compute_with_block_swap_on_the_cuda_standin(monkeypatch) -> None:
    """The fp8 kernels read weights from the swap engine's slots (and save them for backward) on the
    CUDA path: training with swap equals training without it, with no ordering violation."""
    from cuda_standin import AsyncCuda
    from test_cuda_rehearsal import installed
    from test_swap import assert_same_training, flux_blocks

    def build():
        model = build_flux(ckpt=True, fp8=True)
        enable(model)
        return model

    batches = flux_batches(2, h=4, w=4, txt=16)
    ref = train(build(), batches, flux_loss)
    fake = AsyncCuda(fuzz=9)
    fake.install(monkeypatch)
    model, sw = installed(build, flux_blocks, fake)
    with fake.active():
        got = train(model, batches, flux_loss, sw)
    assert_same_training(ref, got)
    assert fake.violations == [] and sw.stats.loads > 0


@pytest.mark.gpu
def test_on_a_gpu_with_fp8_tensor_cores_one_layer_within_fp8_error() -> None:
    """The same check on CUDA under bf16 autocast, where the kernel is the tensor cores' (rows and
    sizes multiples of 16, row-wise scales, bf16 output)."""
    from imglora.memory import to_device

    ok, why = supported(torch.device("cuda", torch.cuda.current_device()))
    if not ok:
        pytest.skip(why)
    _, _, wrapper = one_layer(True)
    to_device(wrapper, "cuda")
    quant = wrapper[0]
    x = (torch.randn(4, 16, 256, device="cuda") * 3).requires_grad_()
    g = torch.randn(4, 16, 128, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y0 = quant(x)
    (gx0,) = torch.autograd.grad(y0, x, g)
    state = enable(wrapper)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y1 = quant(x)
    (gx1,) = torch.autograd.grad(y1, x, g)
    assert state.fp8_calls == 1 and y1.dtype == torch.bfloat16
    assert rel(y1, y0) < 0.04 and rel(gx1, gx0) < 0.04


def test_fp16_gradients_with_small_scales_stay_finite_and_within_fp8_error() -> None:
    """In fp16 the weights' scales (absmax / 448) and their products with the gradient are below
    fp16's normal range for small weights: the backward folds them in fp32."""
    torch.manual_seed(5)
    dense = nn.Linear(256, 128).half()
    with torch.no_grad():
        dense.weight.mul_(0.05)  # absmax about 3e-3: scales about 7e-6, subnormal in fp16
    dense.requires_grad_(False)
    ref = dense.weight.float().clone()
    wrapper = nn.Sequential(dense)
    quantize_fp8(wrapper)
    enable(wrapper)
    x = torch.randn(32, 256).half().requires_grad_()
    g = torch.randn(32, 128).half()
    (gx,) = torch.autograd.grad(wrapper[0](x), x, g)
    assert torch.isfinite(gx).all()
    assert rel(gx, g.float() @ ref) < 0.05  # e4m3 rounding of the gradient and the weight

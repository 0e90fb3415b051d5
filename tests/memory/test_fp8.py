"""FP8 base weights (optimum-quanto qfloat8): accuracy, memory accounting, LoRA left trainable."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from imglora.memory import quantize_fp8, tensor_bytes, to_device, weight_bytes
from imglora.memory.fp8 import _excluded

# e4m3 keeps 3 mantissa bits: round-to-nearest has unit roundoff u = 2**-4 and a relative error
# uniform in [-u, u] at worst, rms u/sqrt(3). A dot product averages the independent per-weight
# errors, so a quantized layer's output is off by about that rms relative amount or less; a stack
# of residual blocks does not compound it (the residual stream carries the unquantized input
# along, and the FLUX embedders and final projection stay in high precision).
FP8_RMS_BOUND = 2**-4 / math.sqrt(3)  # 0.036

FLUX_LORA = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "proj_mlp", "proj_out"]
FLUX_EXCLUDE = ["x_embedder", "context_embedder", "time_text_embed*", "norm_out*", "proj_out"]



def is_fp8(module: nn.Module) -> bool:
    from optimum.quanto import QModuleMixin

    return isinstance(module, QModuleMixin) and type(module.weight).__name__ == "WeightQBytesTensor"


def add_lora(model: nn.Module, targets: list[str], seed: int = 5) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, target_modules=targets), model)
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero
            p.data = (torch.randn(p.shape, generator=g) * 0.05).to(p.dtype)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(h + self.fc2(F.gelu(self.fc1(h))))


def build_mlp(order: str | None = "lora-first") -> MLP:
    torch.manual_seed(0)
    m = MLP()
    m.requires_grad_(False)
    if order == "lora-first":
        add_lora(m, ["fc1", "fc2", "head"])
        quantize_fp8(m, exclude=["embed", "head"])
    elif order == "quantize-first":
        quantize_fp8(m, exclude=["embed", "head"])
        add_lora(m, ["fc1", "fc2", "head"])
    return m


def build_flux(dtype: torch.dtype = torch.float32, fp8: bool = True, lora: bool = True):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    m = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=4, num_single_layers=8, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ).to(dtype)  # fmt: skip
    m.requires_grad_(False)
    if lora:
        add_lora(m, FLUX_LORA)
    report = quantize_fp8(m, exclude=FLUX_EXCLUDE) if fp8 else None
    return m, report


def flux_inputs(dtype: torch.dtype = torch.float32, h: int = 4, w: int = 4, txt: int = 8) -> dict:
    g = torch.Generator().manual_seed(3)
    img_ids = torch.zeros(h * w, 3)
    img_ids[:, 1] = torch.arange(h).repeat_interleave(w)
    img_ids[:, 2] = torch.arange(w).repeat(h)
    return dict(
        hidden_states=torch.randn(2, h * w, 64, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(2, txt, 32, generator=g).to(dtype),
        pooled_projections=torch.randn(2, 32, generator=g).to(dtype),
        timestep=torch.rand(2, generator=g).to(dtype),
        guidance=torch.ones(2, dtype=dtype),
        img_ids=img_ids,
        txt_ids=torch.zeros(txt, 3),
        return_dict=False,
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ------------------------------------------------------------------------------------ tests


def test_single_layer_error_is_within_e4m3_rounding() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(256, 128).requires_grad_(False)
    x = torch.randn(64, 256)
    ref = lin(x)
    model = nn.Sequential(lin)
    quantize_fp8(model)
    err = rel_err(model(x), ref)
    assert 1e-4 < err < FP8_RMS_BOUND, err


def test_report_types_and_lora_untouched() -> None:
    m = build_mlp()
    assert is_fp8(m.fc1.base_layer) and is_fp8(m.fc2.base_layer)
    # excluded by pattern, also through peft's ".base_layer"
    assert type(m.embed) is nn.Linear and type(m.head.base_layer) is nn.Linear
    for name, mod in m.named_modules():
        if "lora_" in name and isinstance(mod, nn.Linear):
            assert type(mod) is nn.Linear, name
    for name, p in m.named_parameters():
        assert p.requires_grad == ("lora_" in name), name
        if p.requires_grad:
            assert p.dtype == torch.float32


def test_report_counts_and_bytes() -> None:
    torch.manual_seed(0)
    m = MLP().requires_grad_(False)
    before = sum(p.numel() * 4 for p in m.parameters())
    report = quantize_fp8(m, exclude=["embed", "head"])
    assert (report.n_quantized, report.n_kept, report.kept) == (2, 2, ("embed", "head"))
    assert report.bytes_before == before == weight_bytes(MLP())
    # fc1/fc2: 1 byte per weight + an fp32 scale per output row + fp32 bias + quanto's two scalars
    q = lambda i, o: i * o + 4 * o + 4 * o + 2 * 4  # noqa: E731
    kept = (8 * 32 + 32) * 4 + (32 * 4 + 4) * 4
    assert report.bytes_after == weight_bytes(m) == kept + q(32, 64) + q(64, 32)
    assert report.bytes_after < report.bytes_before
    w = m.fc1.weight
    assert tensor_bytes(w) == w._data.numel() + w._scale.numel() * 4
    assert w.numel() * w.element_size() == 4 * tensor_bytes(w._data)  # why numel() would be wrong
    assert "2 Linear layers quantized, 2 kept" in report.summary()


def test_both_orders_give_the_same_training_step() -> None:
    """peft 0.21 wraps quanto's QLinear as a plain Linear, so quantize-then-inject works too; the
    chosen order (inject, then quantize the base_layer) must compute exactly the same."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    out = {}
    for order in ("lora-first", "quantize-first"):
        m = build_mlp(order)
        loss = m(x).pow(2).mean()
        loss.backward()
        grads = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
        assert len(grads) == 6 and all(g is not None and g.abs().sum() > 0 for g in grads.values())
        out[order] = (loss.detach(), grads)
    torch.testing.assert_close(out["lora-first"][0], out["quantize-first"][0])
    for n, g in out["lora-first"][1].items():
        torch.testing.assert_close(g, out["quantize-first"][1][n])


def test_flux_fp8_output_error_is_bounded() -> None:
    ref_model, _ = build_flux(fp8=False)
    model, report = build_flux(fp8=True)
    x = flux_inputs()
    with torch.no_grad():
        err = rel_err(model(**x)[0], ref_model(**x)[0])
    assert 1e-4 < err < FP8_RMS_BOUND, err  # measured ~0.8% with these seeds
    assert report.bytes_after < 0.5 * report.bytes_before
    assert report.n_quantized > 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flux_fp8_excluded_kept_and_lora_trains(dtype) -> None:
    model, report = build_flux(dtype)
    assert set(report.kept) == {
        "x_embedder", "context_embedder", "proj_out.base_layer", "norm_out.linear",
        *(f"time_text_embed.{e}.linear_{i}" for e in ("timestep_embedder", "guidance_embedder", "text_embedder") for i in (1, 2)),
    }  # fmt: skip
    for name in report.kept:
        assert type(model.get_submodule(name)) is nn.Linear, name
    # the single blocks' own proj_out is not the top-level "proj_out": it is quantized
    assert is_fp8(model.single_transformer_blocks[0].proj_out.base_layer)
    assert is_fp8(model.transformer_blocks[0].attn.to_q.base_layer)
    assert is_fp8(model.transformer_blocks[0].ff.net[2])  # no LoRA there: quantized in place

    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    assert all(p.dtype == dtype for p in lora.values())  # LoRA kept in the model dtype, not fp8
    out = model(**flux_inputs(dtype))[0]
    out.float().pow(2).mean().backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.dtype == dtype, n
        else:
            assert p.grad is None, n


def test_fp32_lora_on_bf16_fp8_base() -> None:
    """The usual mixed setup: bf16 base (fp8 storage, bf16 scales) with fp32 LoRA weights."""
    model, _ = build_flux(torch.bfloat16)
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**flux_inputs(torch.bfloat16))[0]
    out.float().pow(2).mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert model.transformer_blocks[0].attn.to_q.base_layer.weight._scale.dtype == torch.bfloat16


def test_exclude_patterns() -> None:
    assert _excluded("proj_out", ["proj_out"])
    assert _excluded("proj_out.base_layer", ["proj_out"])  # peft wrapper
    assert not _excluded("single_transformer_blocks.0.proj_out", ["proj_out"])
    assert _excluded("time_text_embed.text_embedder.linear_1", ["time_text_embed*"])
    assert _excluded("norm_out.linear", ["norm_out"])  # excluding a module keeps its subtree
    assert _excluded("transformer_blocks.3.ff.net.2", ["transformer_blocks.*.ff.*"])
    assert not _excluded("x_embedder", [])


def test_bad_arguments_and_trainable_linears() -> None:
    torch.manual_seed(0)
    m = MLP().requires_grad_(False)
    m.head.requires_grad_(True)  # trained fully: must stay a dense Linear
    with pytest.raises(TypeError, match="sequence of patterns"):
        quantize_fp8(m, exclude="embed")  # type: ignore[arg-type]
    report = quantize_fp8(m)
    assert report.n_quantized == 3 and type(m.head) is nn.Linear and m.head.weight.requires_grad


def test_to_device_keeps_portable_quanto_layout() -> None:
    m = build_mlp()
    w = m.fc1.base_layer.weight
    to_device(m, "meta")  # a device-type change, checkable without a GPU
    w2 = m.fc1.base_layer.weight
    assert type(w2) is type(w) and w2._data.is_meta and w2._scale.is_meta
    assert not w2.requires_grad and isinstance(w2, nn.Parameter)
    assert m.fc1.lora_A["default"].weight.is_meta and m.fc1.lora_A["default"].weight.requires_grad


# ------------------------------------------------------------------------------------ CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["quantize-on-cpu", "quantize-on-cuda"])
def test_cuda_bf16_fp8_keeps_bias_and_portable_layout(where) -> None:
    """bf16 shapes that quanto would put in its Marlin layout (which drops the bias in 0.2.7)."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 256).to(torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        lin.bias.normal_(std=1.0)
    m = nn.Sequential(lin)
    if where == "quantize-on-cuda":
        to_device(m, "cuda")
        quantize_fp8(m)
    else:
        quantize_fp8(m)
        to_device(m, "cuda")
    w = m[0].weight
    assert type(w).__name__ == "WeightQBytesTensor" and w._data.is_cuda
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = m(x)
    deq = w._data.to(torch.bfloat16) * w._scale
    torch.testing.assert_close(y, x @ deq.t() + m[0].bias, rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    torch.testing.assert_close(x.grad, deq.sum(0).expand_as(x).to(x.grad.dtype), rtol=2e-2, atol=2e-2)

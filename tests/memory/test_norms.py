"""memory.norms_in_model_dtype: LayerNorm and GroupNorm keep the model dtype under autocast."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from imglora.plan import predict as plan, timing as plan_time
from imglora.commands.common import family_of, load_config
from imglora.memory import norms
from imglora.plan.meta_run import Autocast
from imglora.models.resolve import resolve_model

REPO = Path(__file__).resolve().parents[2]


class Modulated(nn.Module):
    """FLUX's pattern: a LayerNorm without weights, modulated, then three Linear layers."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64, elementwise_affine=False, eps=1e-6)
        self.q, self.k, self.v = (nn.Linear(64, 64).to(dtype) for _ in range(3))
        self.group = nn.GroupNorm(4, 16).to(dtype)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        h = self.norm(x) * (1 + scale) + shift
        return self.q(h) + self.k(h) + self.v(h)


def test_the_norms_run_with_autocast_off_in_their_own_dtype(monkeypatch) -> None:
    """CUDA autocast runs layer_norm and group_norm in fp32 (CPU autocast does not, so the real
    policy cannot be shown here): installed, each norm runs with autocast off for its device, in
    the input's dtype."""
    m = Modulated()
    seen: list[bool] = []
    real = F.layer_norm
    monkeypatch.setattr(F, "layer_norm", lambda *a, **k: seen.append(torch.is_autocast_enabled("cpu")) or real(*a, **k))
    x = torch.randn(2, 32, 64).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m.norm(x)
        assert norms.install(m) == 2
        y = m.norm(x)
        assert torch.is_autocast_enabled("cpu")  # on again after the norm
    assert seen == [True, False] and y.dtype == torch.bfloat16


def test_the_bf16_kernel_normalises_as_the_fp32_one_to_bf16_resolution() -> None:
    x = (torch.randn(2, 32, 64) * 5 + 3).bfloat16()
    fp32 = F.layer_norm(x.float(), (64,), eps=1e-6)  # what CUDA autocast computes and keeps
    bf16 = F.layer_norm(x, (64,), eps=1e-6)  # what the setting keeps: fp32 inside the kernel, bf16 out
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), fp32, rtol=2**-8, atol=2**-8)


def test_a_norm_whose_parameters_are_not_the_inputs_dtype_keeps_autocasts_way() -> None:
    norm = nn.LayerNorm(64)  # fp32 weights (a model loaded in fp32)
    norms.install(nn.Sequential(norm))
    with Autocast(torch.bfloat16):  # CUDA autocast's rules, applied at the function level (on CPU tensors)
        assert norm(torch.randn(4, 64).bfloat16()).dtype == torch.float32


def test_the_block_keeps_its_result_within_bf16_resolution_and_gradients_flow() -> None:
    """Under CUDA autocast's rules (memory/meta_run.Autocast, on CPU tensors): the norm and the
    modulation in bf16 instead of fp32 change the block's output and input gradient by about bf16's
    resolution."""
    torch.manual_seed(1)
    m = Modulated()
    x = torch.randn(2, 32, 64).bfloat16().requires_grad_()
    scale, shift = torch.randn(2, 1, 64).bfloat16() * 0.1, torch.randn(2, 1, 64).bfloat16() * 0.1

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with Autocast(torch.bfloat16):
            h = m.norm(x)
            y = m(x, scale, shift)
        (g,) = torch.autograd.grad(y.float().square().sum(), x)
        return h.dtype, y.detach().float(), g.float()

    d0, y0, g0 = run()
    norms.install(m)
    d1, y1, g1 = run()
    assert (d0, d1) == (torch.float32, torch.bfloat16)
    assert float((y1 - y0).norm() / y0.norm()) < 2**-7 and float((g1 - g0).norm() / g0.norm()) < 2**-6
    assert not torch.equal(y1, y0)  # the modulation really ran in bf16


def test_the_meta_run_honours_it() -> None:
    """The plan's meta-device autocast skips the norms as the real one does."""
    m = Modulated().to("meta")
    x = torch.empty(2, 32, 64, device="meta", dtype=torch.bfloat16)
    s = torch.empty(2, 1, 64, device="meta", dtype=torch.bfloat16)
    with Autocast(torch.bfloat16):
        assert m.norm(x).dtype == torch.float32
    norms.install(m)
    with Autocast(torch.bfloat16):
        assert m.norm(x).dtype == torch.bfloat16 and m(x, s, s).dtype == torch.bfloat16


@pytest.mark.slow
def test_the_plan_predicts_less_memory_bound_time_with_it() -> None:
    """The tiny FLUX's plan on an H200: fewer memory-bound seconds with the setting, the same products."""
    cfg = load_config(REPO / "presets" / "tiny-flux.toml", ["data.resolution=64"])
    family = family_of(cfg)
    setting = [plan.Setting("model", 0)]
    h200 = plan_time.gpu("h200")
    src = resolve_model(cfg.model, family)
    got = [plan.predict(c, family, setting, device_kind="cuda", src=src, time_device=h200).settings[0].predicted
           for c in (cfg, cfg.replace(memory={"norms_in_model_dtype": True}))]
    assert got[1].parts["memory-bound"] < got[0].parts["memory-bound"]
    assert got[1].parts["products"] == pytest.approx(got[0].parts["products"])

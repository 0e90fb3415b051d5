"""memory.attention_kernel: every attention of a step (forward, backward, checkpointing's recompute)
runs with the kernel named, and a kernel that cannot run here is refused before the model loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from imglora.training import step as loop
from imglora.commands.common import family_of, load_config
from imglora.errors import ImgloraError
from imglora.memory import attention
from imglora.models.resolve import resolve_model
from loading import tiny_session

REPO = Path(__file__).resolve().parents[2]
MATH = "aten::_scaled_dot_product_attention_math"
CPU_FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"


def _session(*overrides: str) -> tuple[loop.Session, dict[str, torch.Tensor]]:
    cfg = load_config(REPO / "presets" / "tiny-flux.toml", ["memory.blocks_to_swap=0", *overrides])
    family = family_of(cfg)
    src = resolve_model(cfg.model, family)
    s, trainable = tiny_session(family, src, cfg, total=4)
    torch.manual_seed(0)
    return s, family.synthetic_batch(trainable, 64, cfg, torch.device("cpu"))


def _step(s: loop.Session, batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, int]]:
    """One update: its loss and the attention ops that ran (forward and backward)."""
    loss = torch.zeros(())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loop.step(s, loop.simple_micros([batch], torch.Generator().manual_seed(0)), loss)
    names = [e.name for e in prof.events()]
    return float(loss), {k: names.count(k) for k in (MATH, CPU_FLASH)}


def test_a_kernel_that_cannot_run_here_is_refused_with_the_reason() -> None:
    for kernel in ("efficient", "cudnn"):
        with pytest.raises(ImgloraError) as err:
            attention.check(kernel, torch.device("cpu"), torch.float32)
        msg = str(err.value)
        assert msg.startswith(f'memory.attention_kernel = "{kernel}": PyTorch has no such kernel for this run '
                              "(cpu, float32 inputs)")
        assert msg.endswith('use "auto" or "math", or "flash"')
    for kernel in ("auto", "math", "flash"):
        attention.check(kernel, torch.device("cpu"), torch.float32)  # no error


def test_auto_on_cuda_is_flash_then_efficient_then_math_never_cudnn() -> None:
    """The list ``auto`` passes on CUDA, read back from PyTorch's own flags inside the context (the
    flags are global, so this runs on a CPU build too): cuDNN off, the other three on, in that order."""
    from torch.nn.attention import SDPBackend

    assert attention.kernels("auto", "cuda") == ("flash", "efficient", "math")
    assert attention.kernels("auto", "cpu") is None  # PyTorch's choice: no cuDNN kernel exists there
    assert attention.kernels("cudnn", "cuda") == ("cudnn",)  # still selectable by name
    before = torch._C._get_sdp_priority_order()
    with attention.context("auto", "cuda"):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
        order = list(torch._C._get_sdp_priority_order())
        wanted = [int(SDPBackend.FLASH_ATTENTION), int(SDPBackend.EFFICIENT_ATTENTION), int(SDPBackend.MATH)]
        assert order[:3] == wanted
    assert torch.backends.cuda.cudnn_sdp_enabled() and list(torch._C._get_sdp_priority_order()) == list(before)
    with attention.context("auto", "cpu"):
        assert torch.backends.cuda.cudnn_sdp_enabled()  # nothing changed off CUDA


def test_a_session_on_cuda_would_enter_that_list(monkeypatch) -> None:
    """MemorySetup.kernel() passes the device its model runs on: ``auto`` on CUDA leaves cuDNN out."""
    from imglora.memory.wrap import MemorySetup

    seen = []
    real = attention.context
    monkeypatch.setattr(attention, "context", lambda k, d="cpu": seen.append((k, d)) or real(k, d))
    with MemorySetup(attention_kernel="auto", device_type="cuda").kernel():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert seen == [("auto", "cuda")]


def test_training_refuses_it_before_the_model_loads(tmp_path, monkeypatch) -> None:
    from imglora.commands.train import train

    cfg = load_config(REPO / "presets" / "tiny-flux.toml", [
        'memory.attention_kernel="efficient"', f'run.output_dir="{tmp_path}"', 'run.name="r"',
        f'data.dir="{REPO / "sample_datasets" / "sks_toy"}"', f'cache.dir="{tmp_path / "cache"}"'])
    loaded = []
    family = family_of(cfg)
    real = type(family).load_trainable
    monkeypatch.setattr(type(family), "load_trainable", lambda *a, **k: loaded.append(1) or real(*a, **k))
    with pytest.raises(ImgloraError, match='memory.attention_kernel = "efficient"'):
        train(cfg, out=lambda s: None)
    assert not loaded and not (tmp_path / "r" / "checkpoints").exists()


def test_every_attention_of_the_step_runs_with_the_kernel_named_recompute_included() -> None:
    auto_loss, auto = _step(*_session())
    math_loss, math = _step(*_session('memory.attention_kernel="math"'))
    _, plain = _step(*_session('memory.attention_kernel="math"', "memory.gradient_checkpointing=false",
                               "memory.offload_checkpoints=false"))
    assert auto[CPU_FLASH] > 0 and auto[MATH] == 0  # PyTorch's choice on the CPU: its flash kernel
    assert math[CPU_FLASH] == 0 and math[MATH] > 0  # none escaped, not even the recompute inside backward
    assert plain[MATH] > 0 and math[MATH] == 2 * plain[MATH]  # checkpointing recomputed each attention with math
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()  # restored after
    # the same update to fp32 rounding (two kernels, two summation orders)
    assert math_loss == pytest.approx(auto_loss, rel=1e-5) and math_loss != 0.0


def test_the_plan_says_what_the_math_kernel_adds() -> None:
    from imglora.commands import plan as plan_cmd

    lines: list[str] = []
    plan_cmd.run(str(REPO / "presets" / "tiny-flux.toml"), ('memory.attention_kernel="math"',), blocks=None,
                 resolution=None, vram=None, host_ram=None, bench_file=None, device="cuda", json_out=None,
                 out=lines.append, gpu="h100")
    note = next(line for line in lines if "memory.attention_kernel" in line)
    assert "full score matrices" in note and "a setting for diagnosis, not for choosing a card" in note

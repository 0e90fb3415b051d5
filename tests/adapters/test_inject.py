"""lora.keep_input_dtype: under autocast, the same result with one saved copy fewer per layer."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from imglora.adapters import inject as lora
from loading import tiny_session


def run(keep: bool) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(torch.bfloat16)
    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=8, lora_alpha=8, target_modules=["0", "2"], init_lora_weights=False), model)
    for p in lora.trainable_parameters(model):
        p.data = p.data.float()  # as training: LoRA in fp32, the base in bf16
    if keep:
        assert lora.keep_input_dtype(model) == 2
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size() if t.data_ptr() != x.data_ptr() else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    y.float().pow(2).sum().backward()
    return y.detach(), [p.grad for p in lora.trainable_parameters(model)] + [x.grad], sum(saved)


def test_lora_input_kept_in_the_autocast_dtype_changes_nothing_but_memory() -> None:
    y_cast, g_cast, saved_cast = run(keep=False)
    y_keep, g_keep, saved_keep = run(keep=True)
    assert torch.equal(y_cast, y_keep)  # bf16 -> fp32 -> bf16 is exact: the same numbers
    assert all(torch.equal(a, b) for a, b in zip(g_cast, g_keep))
    # peft's fp32 copy, cast back to bf16 by autocast, was saved for backward: one copy per layer
    assert saved_keep < saved_cast


def test_loraplus_puts_the_b_matrices_at_the_ratio_and_records_it(tmp_path) -> None:
    """LoRA+ (kohya's loraplus_lr_ratio): the B (up) matrices learn 16 times faster; A at the rate."""
    import json as _json
    from pathlib import Path as _Path

    from imglora.commands.common import load_config
    from imglora.config import ConfigError
    from imglora.families import registry
    from imglora.export.metadata import adapter_type_metadata
    from imglora.models.resolve import resolve_model

    repo = _Path(__file__).resolve().parents[2]
    cfg = load_config(repo / "presets" / "tiny-sdxl.toml", ["lora.loraplus_lr_ratio=16", "train.learning_rate=1e-3",
                                                             "train.warmup_steps=0"])
    family = registry.get("sdxl")
    src = resolve_model(cfg.model.path, family)
    session, trainable = tiny_session(family, src, cfg, total=4)
    names = {id(p): n for n, p in session.model.named_parameters()}
    groups = session.optimizer.param_groups
    assert [g["lr"] for g in groups] == [1e-3, 1.6e-2]
    assert all(".lora_A." in names[id(p)] for p in groups[0]["params"])
    assert all(".lora_B." in names[id(p)] for p in groups[1]["params"]) and groups[1]["params"]
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(session.params)
    assert _json.loads(adapter_type_metadata(cfg, ["lora"])["ss_network_args"]) == {"loraplus_lr_ratio": "16"}
    with pytest.raises(ConfigError, match=r"lora.loraplus_lr_ratio: applies to lora.type = 'lora' or 'dora' only"):
        load_config(repo / "presets" / "tiny-sdxl.toml", ["lora.loraplus_lr_ratio=16", 'lora.type="loha"'])

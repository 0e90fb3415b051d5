"""lora.type = "oft": peft's OFT rotation on each adapted layer's output (what ComfyUI's OFT loader
rebuilds); the config's and the model's refusals; strength as ComfyUI applies it. The export's
exactness in ComfyUI is in tests/adapters (test_adapter_forms, test_trained_types)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from imglora.adapters import forms as af
from imglora.adapters import inject as lora, oft
from imglora.commands.common import load_config
from imglora.errors import ConfigError
from imglora.families import get_family
from imglora.models.resolve import resolve_model

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-flux.toml"
OFT = ['lora.type="oft"', "lora.rank=4", "lora.alpha=0", 'export.format="default"']


def flux_with_oft(*extra: str):
    from diffusers import FluxTransformer2DModel

    cfg = load_config(PRESET, [*OFT, *extra])
    family = get_family("flux")
    model = FluxTransformer2DModel.from_pretrained(resolve_model("tiny:flux", family).root, subfolder="transformer")
    lora.inject(model, family, cfg.lora, seed=0)
    return model, cfg


def test_the_rotation_is_on_the_output_and_starts_as_the_identity() -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    model, _ = flux_with_oft()
    layers = {n: m for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)}
    assert layers and all(isinstance(m, oft.OutputRotation) for m in layers.values())
    name, layer = next((n, m) for n, m in layers.items() if m.in_features != m.out_features)  # an MLP projection
    vec = layer.oft_R["default"].weight
    assert vec.shape == (layer.out_features // 4, 6) and not vec.any()  # blocks of 4 outputs, 4·3/2 each; zero
    x = torch.randn(5, layer.in_features)
    with torch.no_grad():
        assert torch.equal(layer(x), layer.get_base_layer()(x))  # the identity rotation: the base layer exactly
        vec.copy_(torch.randn(vec.shape, generator=torch.Generator().manual_seed(0)) * 0.2)
        y, base = layer(x), layer.get_base_layer()(x)
        # Each block of 4 outputs (bias removed) keeps its norm: a rotation of the output, not of the input.
        b = layer.get_base_layer().bias
        norms = lambda t: (t - b).unflatten(-1, (-1, 4)).norm(dim=-1)  # noqa: E731
        torch.testing.assert_close(norms(y), norms(base), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(y, base, atol=1e-4)
        # Strength s (the evaluation's columns) as ComfyUI patches it: W0 + s²·(W_oft − W0).
        w0 = layer.get_base_layer().weight
        d = af.delta(af.read_peft_module({f"{name}.oft_R.weight": vec}, name, "oft", 0.0, 4), w0)
        lora.set_strength(model, 0.5)
        torch.testing.assert_close(layer(x), x @ (w0 + 0.25 * d).T + b, rtol=1e-5, atol=1e-6)
        lora.set_strength(model, 0.0)
        assert torch.equal(layer(x), base)
        lora.set_strength(model, 1.0)
        torch.testing.assert_close(layer(x), x @ (w0 + d).T + b, rtol=1e-5, atol=1e-6)


def test_the_block_size_must_divide_every_adapted_layers_outputs() -> None:
    with pytest.raises(ConfigError, match=r"lora.rank = 5: OFT's block size must divide every adapted layer's output "
                                          r"features, and \d+ do not: transformer_blocks.0.attn.to_q \(32 outputs\)"):
        flux_with_oft("lora.rank=5")


def test_keys_without_meaning_for_oft_are_refused_at_once() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(PRESET, ['lora.type="oft"', "lora.rank=4", "lora.alpha=6", 'lora.block_ranks={"double" = 8}',
                             'export.format="default"', "lora.text_encoder=true", "lora.loraplus_lr_ratio=16"])
    msg = str(exc.value)
    for key in ("lora.alpha", "lora.block_ranks", "lora.text_encoder"):
        assert f"{key}: has no meaning for lora.type = \"oft\"" in msg
    assert "lora.loraplus_lr_ratio: applies to lora.type = 'lora' or 'dora' only" in msg
    with pytest.raises(ConfigError, match="lora.rank: OFT's block size must be at least 2, got 1"):
        load_config(PRESET, ['lora.type="oft"', "lora.rank=1", "lora.alpha=0", 'export.format="default"'])
    # FLUX's kohya form fuses q, k, v: plain LoRA only, as for LoHa and LoKr
    with pytest.raises(ConfigError, match=r"export.format: kohya fuses q, k and v"):
        load_config(PRESET, ['lora.type="oft"', "lora.rank=4", "lora.alpha=0", 'export.format="kohya"'])


def test_a_parent_preset_s_alpha_is_dropped_with_a_note_when_the_child_chooses_oft(tmp_path: Path) -> None:
    """`--set lora.type="oft"` on a shipped preset whose parent sets alpha (which --set cannot remove):
    the inherited value is dropped with a note; the same key in the preset itself or by --set is an error."""
    parent = tmp_path / "parent.toml"
    parent.write_text(f'extends = "{PRESET}"\n[lora]\nalpha = 12\ndropout = 0.1\n')  # (as presets/sdxl.toml sets alpha)
    child = tmp_path / "child.toml"
    child.write_text(f'extends = "{parent}"\n[export]\nformat = "default"\n')
    cfg = load_config(child, ['lora.type="oft"', "lora.rank=4"])
    assert (cfg.lora.type, cfg.lora.alpha, cfg.lora.dropout) == ("oft", 4.0, 0.0)
    assert f'lora.alpha = 12.0 from the parent preset {parent} is dropped: it has no meaning for lora.type = "oft" ' \
           "(an orthogonal rotation per block of lora.rank outputs, unscaled)" in cfg.notes
    assert f"lora.dropout = 0.1 from the parent preset {parent} is dropped: it applies to lora.type = 'lora' or " \
           "'dora' only, and lora.type = 'oft' (LoHa/LoKr: lora.rank_dropout, lora.module_dropout)" in cfg.notes
    with pytest.raises(ConfigError, match=r'--set lora.alpha: has no meaning for lora.type = "oft" .*; remove it'):
        load_config(child, ['lora.type="oft"', "lora.rank=4", "lora.alpha=6"])
    child.write_text(f'extends = "{parent}"\n[export]\nformat = "default"\n[lora]\nalpha = 6\n')
    with pytest.raises(ConfigError, match=rf"{child}: lora.alpha: has no meaning for lora.type = \"oft\""):
        load_config(child, ['lora.type="oft"', "lora.rank=4"])


def test_merge_and_unmerge_fold_the_rotation_into_the_weight_and_back() -> None:
    import copy

    model, _ = flux_with_oft()
    layer = next(m for m in model.modules() if isinstance(m, oft.OutputRotation))
    with torch.no_grad():
        layer.oft_R["default"].weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, layer.in_features)
    merged = copy.deepcopy(layer)
    w0 = merged.get_base_layer().weight.detach().clone()
    merged.merge()
    with torch.no_grad():
        torch.testing.assert_close(merged(x), layer(x), rtol=1e-5, atol=1e-6)  # merged: the base layer alone
        merged.unmerge()
    torch.testing.assert_close(merged.get_base_layer().weight, w0, rtol=1e-5, atol=1e-6)

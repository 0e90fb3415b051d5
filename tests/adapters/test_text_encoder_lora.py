"""lora.text_encoder: the adapter on SDXL's CLIP-L and CLIP-G (FLUX: CLIP-L; T5 frozen). Their outputs are
no longer cached (FLUX's T5 output still is), the adapted encoders change the text outputs and train at
train.text_encoder_lr, the run resumes bit for bit, and the export's lora_te1_/lora_te2_ (FLUX:
text_encoder.text_model...) keys load in ComfyUI (``comfy_math``) as the trained merged weights."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import comfy_math as comfy
from imglora.training import checkpoint
from imglora.adapters import inject as lora
from imglora.commands.common import load_config
from imglora.commands.export import export as export_run
from imglora.commands.train import train
from imglora.errors import ConfigError
from imglora.families import get_family
from imglora.families._shared.diffusers_image import ADAPTER_FILE, clip_path
from imglora.models.resolve import resolve_model
from imglora.memory.wrap import resolve_swap

REPO = Path(__file__).resolve().parents[2]
RTOL = 1e-5
TE_LR = 2e-3


def run_cfg(family: str, small_run, *extra: str):
    return load_config(REPO / "presets" / f"tiny-{family.replace('_', '-')}.toml", [
        *small_run(), "lora.text_encoder=true", f"train.text_encoder_lr={TE_LR}", "train.max_steps=2",
        "train.checkpoint_every=1", "train.warmup_steps=0", "train.log_every=1", "lora.rank=4", "lora.alpha=6",
        *extra])


def text_entries(cfg) -> int:
    """Cached text entries (cache.dir/text/...)."""
    return sum(1 for _ in (Path(cfg.cache.dir) / "text").rglob("*.safetensors"))


def adapted_encoders(family: str, cfg, adapter: Path) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
    """({part: base encoder}, {part: encoder with the trained adapter}), fp32 on the CPU."""
    fam = get_family(family)
    src = resolve_model(f"tiny:{family}", fam)
    if family == "sdxl":
        _, _, te1, te2 = fam.load_text_encoders(src, torch.device("cpu"), torch.float32)
        base = {"text_encoder": te1, "text_encoder_2": te2}
    else:
        base = {"text_encoder": fam.load_clip(src, torch.float32)}
    adapted = {k: copy.deepcopy(v) for k, v in base.items()}
    lora.inject_text_encoders(adapted, fam, cfg.lora, cfg.train.seed)
    for part, encoder in adapted.items():
        lora.load_adapter_state(encoder, fam.read_adapter(adapter, part))
    return base, adapted


def comfy_te_keys(family: str, part: str, encoder: nn.Module) -> dict[str, str]:
    """ComfyUI's CLIP key map (comfy/lora.py model_lora_keys_clip) for the encoder's layers: kohya's
    lora_te1_/lora_te2_text_model_encoder_layers_N_<self_attn_q_proj|...> for SDXL, the diffusers
    text_encoder.text_model.encoder.layers.N.<...> for FLUX's CLIP-L; {key: module path}."""
    out = {}
    for name, m in encoder.named_modules():
        if isinstance(m, nn.Linear) and ".layers." in name and name.rsplit(".", 2)[-2] in ("self_attn", "mlp"):
            if family == "sdxl":
                out[f"lora_{'te1' if part == 'text_encoder' else 'te2'}_{clip_path(name).replace('.', '_')}"] = name
            else:
                out[f"text_encoder.{clip_path(name)}"] = name
    return out


@pytest.mark.parametrize("family", [pytest.param("sdxl", marks=pytest.mark.slow), "flux"])  # (6-minute default run)
def test_text_encoder_adapter_trains_uncached_and_loads_in_comfyui(family, small_run, tmp_path) -> None:
    cfg = run_cfg(family, small_run)
    lines: list[str] = []
    train(cfg, out=lines.append)
    run = cfg.run_dir
    fam = get_family(family)
    data_line = next(x for x in lines if x.startswith("data:"))
    assert "computed in each update, not cached" in data_line
    if family == "sdxl":  # both encoders trained: no caption is encoded into the cache
        assert text_entries(cfg) == 0
    else:  # T5 stays frozen: its output is still cached, per caption
        assert text_entries(cfg) == 3 and "prompt_embeds of the frozen encoders still cached" in data_line
    weights = load_file(str(run / "adapter" / ADAPTER_FILE))
    parts = {k.split(".", 1)[0] for k in weights}
    assert parts == {fam.denoiser, *fam.text_encoder_parts}

    # the text-encoder adapter trained at its own learning rate and changes the text outputs
    state = checkpoint.load(checkpoint.step_dir(run, 2))
    groups = state["optimizer_state"]["param_groups"]
    assert [g["initial_lr"] for g in groups] == [cfg.train.learning_rate, TE_LR]  # the schedule scales both
    base, adapted = adapted_encoders(family, cfg, run / "adapter")
    tokens = fam.tokenize(fam.load_tokenizers(resolve_model(f"tiny:{family}", fam)), "sks toy on grass", 77)
    for part in base:
        key = "input_ids_2" if part == "text_encoder_2" else "input_ids"
        with torch.no_grad():
            a = base[part](tokens[key][None]).last_hidden_state
            b = adapted[part](tokens[key][None]).last_hidden_state
        assert (a - b).abs().max() > 1e-4, part

    # ComfyUI: every key of the export loaded, the text encoders' patched weights as peft merges them
    sd = load_file(str(export_run(run, out=tmp_path / "x.safetensors", dtype="fp32").path))
    te_keys = {k: (part, path) for part, enc in base.items() for k, path in comfy_te_keys(family, part, enc).items()}
    plain = cfg.replace(memory={"fp8": False, "blocks_to_swap": 0}, lora={"text_encoder": False})
    src = resolve_model(f"tiny:{family}", fam)
    den = fam.load_trainable(src, plain, torch.device("cpu"), torch.float32, resolve_swap(fam, plain, src)).model
    types = (nn.Linear, nn.Conv2d) if family == "sdxl" else (nn.Linear,)
    unet_keys = [f"lora_unet_{n.replace('.', '_')}" if family == "sdxl" else f"transformer.{n}"
                 for n, m in den.named_modules() if isinstance(m, types)]
    patches, not_loaded = comfy.load_lora(sd, [*unet_keys, *te_keys])
    assert not_loaded == set(), sorted(not_loaded)[:5]
    te_patched = {k: v for k, v in patches.items() if k in te_keys}
    assert len(te_patched) == sum(1 for enc in adapted.values() for m in enc.modules() if hasattr(m, "lora_A"))
    for key, adapter in te_patched.items():
        part, path = te_keys[key]
        layer = copy.deepcopy(adapted[part].get_submodule(path))
        w0 = layer.get_base_layer().weight.detach().clone()
        layer.merge(safe_merge=True)
        got = comfy.calculate_weight(adapter, w0, key)
        assert adapter.error is None
        assert ((got - layer.get_base_layer().weight).abs().max() / w0.abs().max()).item() <= RTOL, key


@pytest.mark.slow
def test_text_encoder_run_resumes_bit_for_bit(small_run) -> None:
    cfg = run_cfg("sdxl", small_run, 'lora.type="dora"')
    train(cfg, out=lambda _: None)
    final = load_file(str(cfg.run_dir / "adapter" / ADAPTER_FILE))
    shutil.rmtree(checkpoint.step_dir(cfg.run_dir, 2))
    shutil.rmtree(cfg.run_dir / "adapter")
    train(cfg, resume=True, out=lambda _: None)
    again = load_file(str(cfg.run_dir / "adapter" / ADAPTER_FILE))
    assert any(k.startswith("text_encoder_2.") for k in final)
    assert final.keys() == again.keys() and all(torch.equal(final[k], again[k]) for k in final)


def test_text_encoder_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="text-encoder training is implemented for the sdxl, flux and flux_kontext families"):
        load_config(REPO / "presets" / "tiny-llm.toml", ["lora.text_encoder=true"])
    with pytest.raises(ConfigError, match="train.text_encoder_lr: applies with lora.text_encoder = true only"):
        load_config(REPO / "presets" / "tiny-sdxl.toml", ["train.text_encoder_lr=1e-4"])
    assert load_config(REPO / "presets" / "tiny-sdxl.toml").lora.text_encoder is False

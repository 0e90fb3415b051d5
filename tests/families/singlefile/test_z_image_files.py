"""Z-Image from ComfyUI's split files: the transformer in its original layout (q, k and v fused,
bare or under model.diffusion_model., fp32 or fp8), Qwen3-4B in Hugging Face's names and FLUX.1's
ae, each read into exactly the model the diffusers folder gives, and the transformer as diffusers'
own converter reads it; the files are told apart from their headers; training from them is
training from the folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from layouts import FP8, make_comfyui_tree, write_flux_ae, write_qwen3, write_z_image_transformer
from safetensors.torch import load_file, save_file
from test_qwen_image_files import assert_same_training

from imglora.commands.common import load_config
from imglora.errors import ModelSourceError
from imglora.families import registry
from imglora.families._shared.singlefile.inspect import describe
from imglora.families.z_image import singlefile
from imglora.families.z_image.model import BLOCKS
from imglora.models.resolve import resolve_model
from imglora.models.source import ModelSource
from imglora.models.tiny import ensure_tiny

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_tiny(registry.get("z_image"))


def folder_state(tiny: Path, sub: str) -> dict[str, torch.Tensor]:
    (f,) = (tiny / sub).glob("*.safetensors")
    return load_file(str(f))


def q(p: Path) -> str:
    return json.dumps(str(p))


def test_the_files_are_told_apart_from_their_headers(tiny: Path, tmp_path: Path) -> None:
    t = describe(write_z_image_transformer(tiny, tmp_path / "t.safetensors", prefix="model.diffusion_model.", fp8=True))
    assert (t.kind, t.prefix, t.fp8) == ("z-image-transformer", "model.diffusion_model.", True)
    assert describe(write_z_image_transformer(tiny, tmp_path / "b.safetensors")).prefix == ""
    # the tiny encoder is 32 wide: named as a Qwen3 of another width; the real one (2560) is Qwen3-4B
    assert "a Qwen3 text encoder of width 32" in str(describe(write_qwen3(tiny, tmp_path / "te.safetensors")))
    te = load_file(str(tmp_path / "te.safetensors"))
    wide = {k: v for k, v in te.items() if k != "model.embed_tokens.weight"}
    save_file({**wide, "model.embed_tokens.weight": torch.zeros(4, 2560)}, tmp_path / "te4b.safetensors")
    assert describe(tmp_path / "te4b.safetensors").kind == "qwen3-4b"
    assert describe(write_flux_ae(ensure_tiny(registry.get("flux")), tmp_path / "ae.safetensors")).kind == "vae-flux"
    with pytest.raises(ModelSourceError, match=r"t.safetensors is not a Qwen-Image transformer.*"
                                               r"model.family = \"z_image\""):
        from imglora.families._shared.singlefile.inspect import expect

        expect(tmp_path / "t.safetensors", "qwen-image-transformer")


def test_each_file_reads_into_the_folders_model(tiny: Path, tmp_path: Path, monkeypatch) -> None:
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    from imglora.families._shared.singlefile import inspect

    path = write_z_image_transformer(tiny, tmp_path / "t.safetensors", prefix="model.diffusion_model.")
    blocks = []
    model = singlefile.load_transformer(path, tiny, on_block=lambda *a: blocks.append(a[:2]), blocks=BLOCKS)
    assert blocks == [("noise", 0), ("context", 0), ("layer", 0), ("layer", 1), ("layer", 2)]
    want = folder_state(tiny, "transformer")
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # diffusers' own reading of the original layout gives the same tensors
    theirs = convert_z_image_transformer_checkpoint_to_diffusers(load_file(str(path)))
    assert theirs.keys() == want.keys() and all(torch.equal(theirs[k], want[k]) for k in want)
    # Qwen3 and the VAE (the tiny encoder is 32 wide: accept it as Qwen3-4B here)
    real = inspect.classify
    monkeypatch.setattr(inspect, "classify", lambda r: inspect.Layout(kind="qwen3-4b", path=r.path)
                        if "model.layers.0.self_attn.q_norm.weight" in r.key_set else real(r))
    src = ModelSource(tiny, {"text_encoder": write_qwen3(tiny, tmp_path / "te.safetensors"),
                             "vae": write_flux_ae(tiny, tmp_path / "ae.safetensors")})
    te = singlefile.load_text_encoder(src, torch.float32).state_dict()
    want = folder_state(tiny, "text_encoder")
    assert te.keys() == want.keys() and all(torch.equal(te[k], want[k]) for k in want)
    vae = singlefile.load_vae(src, torch.float32).state_dict()
    want = folder_state(tiny, "vae")
    assert vae.keys() == want.keys() and all(torch.equal(vae[k], want[k]) for k in want)


def test_fp8_files_are_their_stored_values_upcast(tiny: Path, tmp_path: Path) -> None:
    path = write_z_image_transformer(tiny, tmp_path / "t.safetensors", fp8=True)
    model = singlefile.load_transformer(path, tiny, dtype=torch.bfloat16, blocks=BLOCKS)
    stored = load_file(str(path))
    qkv = stored["layers.0.attention.qkv.weight"]
    assert qkv.dtype == FP8
    k = model.state_dict()["layers.0.attention.to_k.weight"]
    assert torch.equal(k, qkv.to(torch.float32).chunk(3)[1].to(torch.bfloat16))


@pytest.mark.slow  # (the default run keeps under 6 minutes; CI runs it)
def test_training_from_comfyuis_files_is_training_from_the_folder(tiny: Path, tmp_path: Path, sample_dataset: Path,
                                                                  monkeypatch) -> None:
    """z_image_*.safetensors, qwen_3_4b.safetensors and ae.safetensors found by bare name in a ComfyUI
    folder; the shipped Z-Image Turbo configs with ComfyUI's Qwen tokenizer; the preset's FP8 base
    and swapped block, from either source."""
    from imglora.families._shared.singlefile import configdir, inspect

    real = inspect.classify
    monkeypatch.setattr(inspect, "classify", lambda r: inspect.Layout(kind="qwen3-4b", path=r.path)
                        if "model.layers.0.self_attn.q_norm.weight" in r.key_set else real(r))
    d = tmp_path / "files"
    comfy = make_comfyui_tree(tmp_path / "ComfyUI", {
        "models/diffusion_models/z_image_fp32.safetensors": write_z_image_transformer(tiny, d / "t.safetensors"),
        "models/text_encoders/qwen_3_4b.safetensors": write_qwen3(tiny, d / "te.safetensors"),
        "models/vae/ae.safetensors": write_flux_ae(tiny, d / "ae.safetensors")})
    shutil.copytree(tiny / "tokenizer", comfy / "comfy" / "text_encoders" / "qwen25_tokenizer")
    names = [f"model.comfyui={q(comfy)}", 'model.path="z_image_fp32.safetensors"',
             'model.text_encoder="qwen_3_4b.safetensors"', 'model.vae="ae.safetensors"']

    def preset(*extra: str):
        return load_config(REPO / "presets" / "tiny-z-image.toml", [
            f"data.dir={q(sample_dataset)}", f"cache.dir={q(tmp_path / 'cache')}", f"run.output_dir={q(tmp_path / 'runs')}",
            "train.max_steps=2", "train.warmup_steps=0", "train.log_every=1", "train.checkpoint_every=0", *extra])

    family = registry.get("z_image")
    monkeypatch.setattr(configdir, "hub_snapshot", lambda repo: None)  # an empty Hugging Face cache
    monkeypatch.setenv("IMGLORA_HOME", str(tmp_path / "home"))
    shipped = resolve_model(preset(*names).model, family)
    t = json.loads((shipped.root / "transformer" / "config.json").read_text())
    assert (t["n_layers"], t["dim"], t["cap_feat_dim"]) == (30, 3840, 2560)
    with pytest.raises(ModelSourceError, match=r"is a Z-Image transformer alone; Z-Image also needs Qwen3-4B and "
                                               r"FLUX.1's VAE as files: set model.vae \(e.g. ae.safetensors\)"):
        resolve_model(preset(*names[:3]).model, family)
    assert_same_training(preset("run.name=folder"), preset("run.name=files", *names, f"model.config={q(tiny)}"))

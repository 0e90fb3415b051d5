"""Qwen-Image from ComfyUI's split files: the transformer (bf16 or plain fp8, bare or under
model.diffusion_model.), Qwen2.5-VL-7B in scaled fp8 and the VAE in Wan 2.1's layout, each read
into exactly the model the diffusers folder gives (fp8: exactly the upcast stored values times
their scale); the files are told apart from their headers; training from them is training from
the folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from layouts import (FP8, make_comfyui_tree, write_bfl_flux, write_qwen25_vl, write_qwen_image_transformer,
                     write_qwen_image_vae)
from safetensors.torch import load_file, save_file

from imglora.commands.common import load_config
from imglora.errors import ModelSourceError
from imglora.families import registry
from imglora.families.qwen_image import singlefile
from imglora.families._shared.singlefile.inspect import describe
from imglora.models.resolve import resolve_model
from imglora.models.source import ModelSource
from imglora.models.tiny import ensure_tiny

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_tiny(registry.get("qwen_image"))


def folder_state(tiny: Path, sub: str) -> dict[str, torch.Tensor]:
    (f,) = (tiny / sub).glob("*.safetensors")
    return load_file(str(f))


def test_the_files_are_told_apart_from_their_headers(tiny: Path, tmp_path: Path) -> None:
    t = describe(write_qwen_image_transformer(tiny, tmp_path / "t.safetensors", fp8=True))
    assert (t.kind, t.prefix, t.fp8) == ("qwen-image-transformer", "model.diffusion_model.", True)
    assert describe(write_qwen_image_transformer(tiny, tmp_path / "b.safetensors", prefix="")).prefix == ""
    te = describe(write_qwen25_vl(tiny, tmp_path / "te.safetensors", scaled_fp8=True))
    assert (te.kind, te.fp8, te.scaled) == ("qwen25-vl-7b", True, True)
    assert describe(write_qwen_image_vae(tiny, tmp_path / "vae.safetensors")).kind == "vae-qwen-image"
    # Qwen-Image 2.1 (another text embedder), a text-only Qwen2.5, Wan 2.2's VAE: named, refused.
    sd = load_file(str(tmp_path / "b.safetensors"))
    save_file({**sd, "txt_in.text_norm.weight": torch.ones(2)}, tmp_path / "q21.safetensors")
    assert "Qwen-Image 2.1" in str(describe(tmp_path / "q21.safetensors"))
    te_sd = load_file(str(tmp_path / "te.safetensors"))
    save_file({k: v for k, v in te_sd.items() if not k.startswith("visual.")}, tmp_path / "llm.safetensors")
    assert "no vision tower" in str(describe(tmp_path / "llm.safetensors"))
    vae_sd = load_file(str(tmp_path / "vae.safetensors"))
    save_file({**vae_sd, "decoder.upsamples.0.upsamples.0.residual.2.weight": torch.ones(1)}, tmp_path / "w22.safetensors")
    assert "Wan 2.2" in str(describe(tmp_path / "w22.safetensors"))


def test_each_file_reads_into_the_folders_model(tiny: Path, tmp_path: Path) -> None:
    src = ModelSource(tiny, {"transformer": write_qwen_image_transformer(tiny, tmp_path / "t.safetensors"),
                             "text_encoder": write_qwen25_vl(tiny, tmp_path / "te.safetensors"),
                             "vae": write_qwen_image_vae(tiny, tmp_path / "v.safetensors")})
    blocks = []
    model = singlefile.load_transformer(src.files["transformer"], tiny, on_block=lambda *a: blocks.append(a[:2]))
    assert blocks == [("block", 0), ("block", 1), ("block", 2)]
    want = folder_state(tiny, "transformer")
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    vae = singlefile.load_vae(src, torch.float32).state_dict()
    want = folder_state(tiny, "vae")
    assert vae.keys() == want.keys() and all(torch.equal(vae[k], want[k]) for k in want)
    te = singlefile.load_text_encoder(src, torch.float32).state_dict()
    want = {("language_model." + k[6:] if k.startswith("model.") else k): v
            for k, v in folder_state(tiny, "text_encoder").items() if k != "lm_head.weight"}
    assert te.keys() == want.keys() and all(torch.equal(te[k], want[k]) for k in want)


def test_fp8_files_are_their_stored_values_upcast_times_their_scales(tiny: Path, tmp_path: Path) -> None:
    path = write_qwen_image_transformer(tiny, tmp_path / "t.safetensors", fp8=True, prefix="")
    model = singlefile.load_transformer(path, tiny, dtype=torch.bfloat16)
    stored = load_file(str(path))
    assert all(torch.equal(v, stored[k].to(torch.float32).to(torch.bfloat16)) for k, v in model.state_dict().items())
    te_path = write_qwen25_vl(tiny, tmp_path / "te.safetensors", scaled_fp8=True)
    te = singlefile.load_text_encoder(ModelSource(tiny, {"text_encoder": te_path}), torch.float32).state_dict()
    stored = load_file(str(te_path))
    key = "model.layers.0.mlp.up_proj.weight"
    assert stored[key].dtype == FP8
    assert torch.equal(te["language_model.layers.0.mlp.up_proj.weight"],
                       stored[key].to(torch.float32) * stored["model.layers.0.mlp.up_proj.scale_weight"])
    # the dequantized encoder is the fp32 one within e4m3's rounding (3 mantissa bits: 2^-4 relative)
    fp32 = folder_state(tiny, "text_encoder")[key]
    torch.testing.assert_close(te["language_model.layers.0.mlp.up_proj.weight"], fp32, rtol=0.07, atol=1e-3)


def q(p: Path) -> str:
    return json.dumps(str(p))


@pytest.mark.slow
def test_training_from_comfyuis_files_is_training_from_the_folder(tiny: Path, tmp_path: Path, sample_dataset: Path,
                                                                  monkeypatch) -> None:
    """qwen_image_*.safetensors, qwen_2.5_vl_7b*.safetensors and qwen_image_vae.safetensors found by bare
    name in a ComfyUI folder, the shipped Qwen-Image configs with ComfyUI's Qwen2.5 tokenizer."""
    import shutil

    from imglora.families._shared.singlefile import configdir

    comfy, names = comfyui_files(tiny, tmp_path, "qwen_image_fp32.safetensors")

    def preset(*extra: str):
        return load_config(REPO / "presets" / "tiny-qwen-image.toml", [
            f"data.dir={q(sample_dataset)}", f"cache.dir={q(tmp_path / 'cache')}", f"run.output_dir={q(tmp_path / 'runs')}",
            "train.max_steps=2", "train.warmup_steps=0", "train.log_every=1", "train.checkpoint_every=0", *extra])

    family = registry.get("qwen_image")
    monkeypatch.setattr(configdir, "hub_snapshot", lambda repo: None)  # an empty Hugging Face cache
    monkeypatch.setenv("IMGLORA_HOME", str(tmp_path / "home"))
    shipped = resolve_model(preset(*names).model, family)
    t = json.loads((shipped.root / "transformer" / "config.json").read_text())
    assert (t["num_layers"], t["joint_attention_dim"]) == (60, 3584)
    assert (shipped.root / "tokenizer" / "vocab.json").is_file()
    with pytest.raises(ModelSourceError, match=r"is a Qwen-Image transformer alone; Qwen-Image also needs "
                                               r"Qwen2.5-VL-7B and its VAE as files: set model.vae \(e.g. "
                                               r"qwen_image_vae.safetensors\)"):
        resolve_model(preset(*names[:3]).model, family)
    flux = write_bfl_flux(ensure_tiny(registry.get("flux")), tmp_path / "files" / "flux1-dev.safetensors")
    shutil.copy(flux, comfy / "models" / "diffusion_models" / "flux1-dev.safetensors")
    with pytest.raises(ModelSourceError, match=r"flux1-dev.safetensors is not a Qwen-Image transformer.*"
                                               r"model.family = \"flux\""):
        resolve_model(preset(*names).replace(model={"path": "flux1-dev.safetensors"}).model, family)

    # The preset's FP8 base and swapped block: blocks are quantized as they are read, from either source.
    assert_same_training(preset("run.name=folder"), preset("run.name=files", *names, f"model.config={q(tiny)}"))


@pytest.mark.slow  # (the default run keeps under 6 minutes; CI runs it)
def test_an_edit_model_trains_from_comfyuis_files_as_from_its_folder(tmp_path: Path, monkeypatch) -> None:
    """qwen_image_edit_2509_*.safetensors with Qwen-Image's text encoder and VAE files: the shipped
    Edit Plus configs (its model_index.json and image processor) with ComfyUI's Qwen2.5 tokenizer; the
    captions, read with their sources, and the losses are the folder's."""
    from imglora.families._shared.singlefile import configdir

    family = registry.get("qwen_image_edit_plus")
    tiny = ensure_tiny(family)
    comfy, names = comfyui_files(tiny, tmp_path, "qwen_image_edit_2509_fp32.safetensors")
    edits = REPO / "sample_datasets"

    def preset(*extra: str):
        return load_config(REPO / "presets" / "tiny-qwen-image-edit-plus.toml", [
            f"data.dir={q(edits / 'edit_toy')}", f"data.control_dir={q(edits / 'edit_toy_sources')}",
            f"cache.dir={q(tmp_path / 'cache')}", f"run.output_dir={q(tmp_path / 'runs')}", "data.resolution=64",
            "train.max_steps=2", "train.warmup_steps=0", "train.log_every=1", "train.checkpoint_every=0", *extra])

    monkeypatch.setattr(configdir, "hub_snapshot", lambda repo: None)  # an empty Hugging Face cache
    monkeypatch.setenv("IMGLORA_HOME", str(tmp_path / "home"))
    shipped = resolve_model(preset(*names).model, family)
    assert json.loads((shipped.root / "model_index.json").read_text())["_class_name"] == "QwenImageEditPlusPipeline"
    assert (shipped.root / "processor" / "preprocessor_config.json").is_file()

    assert_same_training(preset("run.name=folder"), preset("run.name=files", *names, f"model.config={q(tiny)}"))


def assert_same_training(folder_cfg, files_cfg) -> None:
    """Two updates from the model folder and from the single files: the same losses, the same adapter."""
    from imglora.commands.train import train

    def trained(cfg):
        result = train(cfg, out=lambda s: None)
        losses = [json.loads(x)["loss"] for x in (cfg.run_dir / "log.jsonl").read_text().splitlines()]
        return losses, load_file(str(result.adapter))

    folder, files = trained(folder_cfg), trained(files_cfg)
    assert folder[0] == files[0] and len(folder[0]) == 2
    assert folder[1].keys() == files[1].keys() and all(torch.equal(folder[1][k], files[1][k]) for k in folder[1])


def comfyui_files(tiny: Path, tmp_path: Path, transformer: str) -> tuple[Path, list[str]]:
    """A ComfyUI folder with ``tiny``'s transformer (named ``transformer``), Qwen2.5-VL and VAE in
    ComfyUI's layouts and Qwen2.5's tokenizer where ComfyUI keeps it; the preset keys naming them."""
    import shutil

    d = tmp_path / "files"
    comfy = make_comfyui_tree(tmp_path / "ComfyUI", {
        f"models/diffusion_models/{transformer}": write_qwen_image_transformer(tiny, d / "t.safetensors"),
        "models/text_encoders/qwen_2.5_vl_7b_fp32.safetensors": write_qwen25_vl(tiny, d / "te.safetensors"),
        "models/vae/qwen_image_vae.safetensors": write_qwen_image_vae(tiny, d / "v.safetensors")})
    shutil.copytree(tiny / "tokenizer", comfy / "comfy" / "text_encoders" / "qwen25_tokenizer")
    return comfy, [f"model.comfyui={q(comfy)}", f'model.path="{transformer}"',
                   'model.text_encoder="qwen_2.5_vl_7b_fp32.safetensors"', 'model.vae="qwen_image_vae.safetensors"']

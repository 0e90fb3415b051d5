"""Qwen-Image 2.1 from the single files ComfyUI users have (Comfy-Org/Qwen-Image-2.1): the transformer in
diffusers' names with each block's img_mlp gate and up projections fused into img_mlp.gate_up (gate rows
first; bare or under model.diffusion_model.; float32 or ComfyUI's scaled fp8), Qwen3-VL-8B in
transformers' layout, and the RGBA VAE in Wan 2.2's nested layout (5-D causal-convolution weights with a
time axis of 1), each read into exactly the model the diffusers folder gives (the transformer also as
diffusers' own converter reads it; the caption states as the folder's Qwen3VLModel gives them); the files
are told apart from their headers; training from them is training from the folder.

The writers turn the tiny diffusers model into those layouts in the diffusers -> file direction: the
fusion as diffusers' convert_qwen_image21_transformer_checkpoint_to_diffusers undoes it, the VAE from
AutoencoderKLQwenImage21's module tree onto Wan 2.2's names (the evidence for that layout is quoted in
imglora.families.qwen_image21.singlefile)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from layouts import FP8, FP8_MAX, make_comfyui_tree
from safetensors.torch import load_file, save_file

from imglora.util.owned import own_module
from imglora.errors import ModelSourceError
from imglora.families import registry
from imglora.families._shared.singlefile import inspect
from imglora.families._shared.singlefile.inspect import describe
from imglora.families.qwen_image21 import singlefile
from imglora.families.qwen_image21.model import BLOCKS
from imglora.models.source import ModelSource
from imglora.models.tiny import ensure_tiny

REPO = Path(__file__).resolve().parents[3]
UNET = "model.diffusion_model."
GATE, UP = ".img_mlp.gate_layer.weight", ".img_mlp.proj.weight"


def component(tiny: Path, sub: str) -> dict[str, torch.Tensor]:
    (f,) = (tiny / sub).glob("*.safetensors")
    return load_file(str(f))


def comfyui_transformer(tiny: Path) -> dict[str, torch.Tensor]:
    """The folder's transformer with each block's gate and up rows fused into img_mlp.gate_up, gate first."""
    sd = component(tiny, "transformer")
    out = {k: v for k, v in sd.items() if not k.endswith((GATE, UP))}
    for k in sd:
        if k.endswith(GATE):
            base = k[: -len(GATE)]
            out[base + ".img_mlp.gate_up.weight"] = torch.cat([sd[k], sd[base + UP]])
    return out


def write_transformer(tiny: Path, out: Path, *, prefix: str = "", scaled_fp8: bool = False) -> Path:
    """qwen_image_2.1_bf16.safetensors (here: float32), or a scaled fp8 one (the blocks' Linear weights as
    weight / scale in float8_e4m3fn with a float32 weight_scale and a comfy_quant marker)."""
    sd = comfyui_transformer(tiny)
    if scaled_fp8:
        for k in list(sd):
            if k.startswith("transformer_blocks.") and k.endswith(".weight") and sd[k].ndim == 2:
                scale = (sd[k].abs().max() / FP8_MAX).float()
                sd[k] = (sd[k] / scale).to(FP8)
                sd[k[: -len("weight")] + "weight_scale"] = scale.reshape(())
                sd[k[: -len("weight")] + "comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'),
                                                                      dtype=torch.uint8)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({prefix + k: v.contiguous() for k, v in sd.items()}, out)
    return out


def write_qwen3vl(tiny: Path, out: Path) -> Path:
    """qwen3vl_8b_bf16.safetensors (here: float32): Qwen3VLForConditionalGeneration's names, as the tiny
    folder saves them (model.language_model.*, model.visual.*, lm_head)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(component(tiny, "text_encoder"), out)
    return out


def wan22_name(key: str, num_res_blocks: int) -> str:
    """An AutoencoderKLQwenImage21 key -> Wan 2.2's nested name."""
    resnet = {"norm1.": "residual.0.", "conv1.": "residual.2.", "norm2.": "residual.3.", "conv2.": "residual.6.",
              "conv_shortcut.": "shortcut."}

    def res(rest: str) -> str:
        return next(new + rest[len(old):] for old, new in resnet.items() if rest.startswith(old))

    outer = {"quant_conv.": "conv1.", "post_quant_conv.": "conv2.", "encoder.conv_in.": "encoder.conv1.",
             "decoder.conv_in.": "decoder.conv1.", "encoder.norm_out.": "encoder.head.0.",
             "decoder.norm_out.": "decoder.head.0.", "encoder.conv_out.": "encoder.head.2.",
             "decoder.conv_out.": "decoder.head.2."}
    for old, new in outer.items():
        if key.startswith(old):
            return new + key[len(old):]
    m = re.fullmatch(r"(encoder|decoder)\.mid_block\.(resnets|attentions)\.(\d)\.(.+)", key)
    if m:
        side, kind, i, rest = m.groups()
        return f"{side}.middle.1.{rest}" if kind == "attentions" else f"{side}.middle.{2 * int(i)}.{res(rest)}"
    m = re.fullmatch(r"(encoder\.down|decoder\.up)_blocks\.(\d+)\.(resnets\.(\d+)|downsampler|upsampler)\.(.+)", key)
    side, level, _, child, rest = m.groups()
    stage = "encoder.downsamples" if side == "encoder.down" else "decoder.upsamples"
    sampler = num_res_blocks if side == "encoder.down" else num_res_blocks + 1  # after the level's residual blocks
    return f"{stage}.{level}.{stage.split('.')[1]}.{child if child is not None else sampler}." + (
        res(rest) if child is not None else rest)


def write_vae(tiny: Path, out: Path) -> Path:
    """qwen_image_2.1_vae_bf16.safetensors (here: float32): Wan 2.2's names, the causal convolutions'
    weights 5-D with a time axis of 1 (Wan's Conv3d; diffusers' 2-D specialisation keeps them 4-D)."""
    from diffusers import AutoencoderKLQwenImage21
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage21 import QwenImage21CausalConv3d

    config = json.loads((tiny / "vae" / "config.json").read_text())
    vae = AutoencoderKLQwenImage21.from_config(config)
    causal = {f"{n}.weight" for n, m in vae.named_modules() if isinstance(m, QwenImage21CausalConv3d)}
    sd = component(tiny, "vae")
    assert causal and causal <= set(sd)
    save_file({wan22_name(k, config["num_res_blocks"]): v[:, :, None] if k in causal else v for k, v in sd.items()},
              out)
    return out


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_tiny(registry.get("qwen_image21"))


@pytest.fixture
def qwen3vl_as_8b(monkeypatch):
    """The tiny encoder is 16 wide: accepted as Qwen3-VL-8B here (the real one is 4096)."""
    real = inspect.classify
    monkeypatch.setattr(inspect, "classify", lambda r: inspect.Layout(kind="qwen3vl-8b", path=r.path)
                        if any("deepstack_merger_list.0.norm.weight" in k for k in r.keys) else real(r))


def test_the_files_are_told_apart_from_their_headers(tiny: Path, tmp_path: Path) -> None:
    t = describe(write_transformer(tiny, tmp_path / "t.safetensors", prefix=UNET, scaled_fp8=True))
    assert (t.kind, t.prefix, t.fp8, t.scaled) == ("qwen-image-2.1-transformer", UNET, True, True)
    assert describe(write_transformer(tiny, tmp_path / "b.safetensors")).prefix == ""
    assert "a Qwen3-VL of width 16" in str(describe(write_qwen3vl(tiny, tmp_path / "te.safetensors")))
    assert describe(write_vae(tiny, tmp_path / "v.safetensors")).kind == "vae-qwen-image-2.1"
    # Wan 2.2's own VAE (48 channels, 12 pixel channels) is the same layout, not this VAE
    sd = load_file(str(tmp_path / "v.safetensors"))
    save_file({**sd, "conv2.weight": torch.zeros(48, 48, 1, 1, 1)}, tmp_path / "w22.safetensors")
    assert "Wan 2.2's layout with 48 latent" in str(describe(tmp_path / "w22.safetensors"))
    with pytest.raises(ModelSourceError, match=r"t.safetensors is not a Qwen-Image transformer.*qwen-image-2.1-"
                                               r"transformer.*model.family = \"qwen_image21\""):
        inspect.expect(tmp_path / "t.safetensors", "qwen-image-transformer")


def test_each_file_reads_into_the_folders_model(tiny: Path, tmp_path: Path, qwen3vl_as_8b) -> None:
    from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers
    from transformers import AutoTokenizer, Qwen3VLModel

    from imglora.families.qwen_image21.model import encode_caption, tokenizer_folder

    want = component(tiny, "transformer")
    for prefix in ("", UNET):
        path = write_transformer(tiny, tmp_path / f"t{len(prefix)}.safetensors", prefix=prefix)
        blocks = []
        model = singlefile.load_transformer(path, tiny, on_block=lambda *a: blocks.append(a[:2]), blocks=BLOCKS)
        assert blocks == [("block", 0), ("block", 1), ("block", 2)]
        got = model.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    theirs = convert_qwen_image21_transformer_checkpoint_to_diffusers(load_file(str(path)))
    assert theirs.keys() == want.keys() and all(torch.equal(theirs[k], want[k]) for k in want)
    src = ModelSource(tiny, {"transformer": path, "vae": write_vae(tiny, tmp_path / "v.safetensors"),
                             "text_encoder": write_qwen3vl(tiny, tmp_path / "te.safetensors")})
    encoder = singlefile.load_text_encoder(src, torch.float32)
    lang = {k[len("model.language_model."):]: v for k, v in component(tiny, "text_encoder").items()
            if k.startswith("model.language_model.")}
    te = encoder.state_dict()
    assert te.keys() == lang.keys() and all(torch.equal(te[k], lang[k]) for k in lang)
    folder = own_module(Qwen3VLModel.from_pretrained(tiny, subfolder="text_encoder")).eval()  # (aligned, as imglora reads)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(tiny))
    with torch.no_grad():  # the language model alone gives the caption the states the whole Qwen3VLModel gives
        assert torch.equal(encode_caption(tokenizer, encoder, "a red cube on grass", 64),
                           encode_caption(tokenizer, folder, "a red cube on grass", 64))
    vae = singlefile.load_vae(src, torch.float32).state_dict()
    want = component(tiny, "vae")
    assert vae.keys() == want.keys() and all(torch.equal(vae[k], want[k]) for k in want)
    base = singlefile.base_weights(src, "transformer", ["transformer_blocks.2.img_mlp.proj"])
    assert torch.equal(base["transformer_blocks.2.img_mlp.proj"], component(tiny, "transformer")[
        "transformer_blocks.2.img_mlp.proj.weight"])


def test_a_scaled_fp8_file_is_its_stored_values_times_their_scale(tiny: Path, tmp_path: Path) -> None:
    """Dequantised exactly as fp8 · scale, the fused tensor's halves as its rows: each weight within
    e4m3's rounding (relative 2⁻⁴, plus half its smallest step, 2⁻¹⁰ · scale, below its normal range)."""
    path = write_transformer(tiny, tmp_path / "t.safetensors", scaled_fp8=True)
    got = singlefile.load_transformer(path, tiny, blocks=BLOCKS).state_dict()
    stored = load_file(str(path))
    w, scale = stored["transformer_blocks.1.img_mlp.gate_up.weight"], stored["transformer_blocks.1.img_mlp.gate_up.weight_scale"]
    half = w.shape[0] // 2
    assert w.dtype == FP8 and torch.equal(got["transformer_blocks.1" + GATE], w[:half].float() * scale)
    assert torch.equal(got["transformer_blocks.1" + UP], w[half:].float() * scale)
    want = component(tiny, "transformer")
    step = max(float(t.abs().max()) for t in want.values()) / FP8_MAX * 2 ** -10
    for k, t in want.items():
        assert bool(((got[k] - t).abs() <= t.abs() * 2 ** -4 + step).all()), k


def test_a_missing_or_odd_key_names_the_file_and_the_key(tiny: Path, tmp_path: Path) -> None:
    sd = comfyui_transformer(tiny)
    save_file({k: v for k, v in sd.items() if k != "transformer_blocks.2.img_mlp.gate_up.weight"},
              tmp_path / "gone.safetensors")
    with pytest.raises(ModelSourceError, match=r"gone.safetensors: the Qwen-Image 2.1 transformer does not fit .*2 "
                                               r"missing: transformer_blocks.2.img_mlp.gate_layer.weight, "
                                               r"transformer_blocks.2.img_mlp.proj.weight"):
        singlefile.load_transformer(tmp_path / "gone.safetensors", tiny, blocks=BLOCKS)
    # Comfy-Org's int8_convrot file: its int8 weights are refused by name
    w = sd["transformer_blocks.0.img_mlp.gate_up.weight"]
    save_file({**sd, "transformer_blocks.0.img_mlp.gate_up.weight": torch.zeros(w.shape, dtype=torch.int8),
               "transformer_blocks.0.img_mlp.gate_up.weight_scale": torch.ones(())}, tmp_path / "int8.safetensors")
    with pytest.raises(ModelSourceError, match=r"int8.safetensors: transformer_blocks.0.img_mlp.gate_up.weight is "
                                               r"stored as torch.int8, a packed quantized format .* use the bf16"):
        singlefile.load_transformer(tmp_path / "int8.safetensors", tiny, blocks=BLOCKS)
    vae = load_file(str(write_vae(tiny, tmp_path / "v.safetensors")))
    save_file({k: v for k, v in vae.items() if k != "decoder.upsamples.1.upsamples.0.residual.6.weight"},
              tmp_path / "vae_gone.safetensors")
    src = ModelSource(tiny, {"vae": tmp_path / "vae_gone.safetensors"})
    with pytest.raises(ModelSourceError, match=r"vae_gone.safetensors: the Qwen-Image 2.1 VAE does not fit .*1 "
                                               r"missing: decoder.up_blocks.1.resnets.0.conv2.weight"):
        singlefile.load_vae(src, torch.float32)


def preset(tmp_path: Path, sample_dataset: Path, *extra: str):
    from imglora.commands.common import load_config

    q = json.dumps
    return load_config(REPO / "presets" / "tiny-qwen-image21.toml", [
        f"data.dir={q(str(sample_dataset))}", f"cache.dir={q(str(tmp_path / 'cache'))}",
        f"run.output_dir={q(str(tmp_path / 'runs'))}", "train.max_steps=2", "train.warmup_steps=0",
        "train.log_every=1", "train.checkpoint_every=0", *extra])


def comfyui(tiny: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    import shutil

    d = tmp_path / "files"
    comfy = make_comfyui_tree(tmp_path / "ComfyUI", {
        "models/diffusion_models/qwen_image_2.1_fp32.safetensors": write_transformer(tiny, d / "t.safetensors"),
        "models/text_encoders/qwen3vl_8b_fp32.safetensors": write_qwen3vl(tiny, d / "te.safetensors"),
        "models/vae/qwen_image_2.1_vae_fp32.safetensors": write_vae(tiny, d / "v.safetensors")})
    shutil.copytree(tiny / "processor", comfy / "comfy" / "text_encoders" / "qwen25_tokenizer",  # (its tokenizer)
                    ignore=shutil.ignore_patterns("preprocessor_config.json", "chat_template.json"))
    return comfy, [f"model.comfyui={json.dumps(str(comfy))}", 'model.path="qwen_image_2.1_fp32.safetensors"',
                   'model.text_encoder="qwen3vl_8b_fp32.safetensors"', 'model.vae="qwen_image_2.1_vae_fp32.safetensors"']


def test_the_shipped_configs_and_comfyuis_tokenizer_are_used(tiny: Path, tmp_path: Path, sample_dataset: Path,
                                                             qwen3vl_as_8b, monkeypatch) -> None:
    from transformers import Qwen3VLConfig

    from imglora.families._shared.singlefile import configdir
    from imglora.families.qwen_image21.model import load_processor
    from imglora.models.resolve import resolve_model

    family = registry.get("qwen_image21")
    monkeypatch.setattr(configdir, "hub_snapshot", lambda repo: None)  # an empty Hugging Face cache
    monkeypatch.setenv("IMGLORA_HOME", str(tmp_path / "home"))
    _, names = comfyui(tiny, tmp_path)
    src = resolve_model(preset(tmp_path, sample_dataset, *names).model, family)
    t = json.loads((src.root / "transformer" / "config.json").read_text())
    assert (t["num_layers"], set(src.files)) == (32, {"transformer", "text_encoder", "vae"})
    te = Qwen3VLConfig.from_pretrained(src.root / "text_encoder")
    assert (te.text_config.hidden_size, te.text_config.num_hidden_layers) == (4096, 36)
    processor = load_processor(src.root)  # the tokenizer in the processor's folder, beside Qwen3-VL's image processor
    assert processor.image_processor.patch_size == 16 and (src.root / "processor" / "vocab.json").is_file()
    with pytest.raises(ModelSourceError, match=r"is a Qwen-Image 2.1 transformer alone; Qwen-Image 2.1 also needs "
                                               r"Qwen3-VL-8B and its VAE as files: set model.vae \(e.g. qwen_image_2.1"):
        resolve_model(preset(tmp_path, sample_dataset, *names[:3]).model, family)


@pytest.mark.slow  # (two short runs: about 3 s on 2 cores)
def test_training_from_comfyuis_files_is_training_from_the_folder(tiny: Path, tmp_path: Path, sample_dataset: Path,
                                                                  qwen3vl_as_8b, monkeypatch) -> None:
    from test_qwen_image_files import assert_same_training

    _, names = comfyui(tiny, tmp_path)
    monkeypatch.setenv("IMGLORA_HOME", str(tmp_path / "home"))
    assert_same_training(preset(tmp_path, sample_dataset, "run.name=folder"),
                         preset(tmp_path, sample_dataset, "run.name=files", *names,
                                f"model.config={json.dumps(str(tiny))}"))

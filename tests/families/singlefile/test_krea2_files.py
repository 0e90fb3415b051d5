"""Krea 2 from the single files ComfyUI users have (Comfy-Org/Krea-2): the transformer in Krea's
original layout (first/tmlp/tproj/txtmlp/txtfusion/blocks/last, wq/wk/wv/wo/gate, mlp, norm scales,
each block's modulation table flat; bare or under model.diffusion_model.; fp32 or ComfyUI's scaled
fp8), Qwen3-VL-4B in transformers' layout (model.language_model.* and model.visual.*, or model.* and
visual.*) and Qwen-Image's VAE in Wan 2.1's, each read into exactly the model the diffusers folder
gives (the transformer also as diffusers' own converter reads it; the caption states as the folder's
Qwen3VLModel gives them); the files are told apart from their headers; training from them is
training from the folder.

The writers turn the tiny diffusers model into those layouts from tables written here in the
diffusers -> original direction, after diffusers' convert_krea2_transformer_checkpoint_to_diffusers and
ComfyUI's krea2_to_diffusers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from layouts import FP8, FP8_MAX, make_comfyui_tree, write_qwen_image_vae
from safetensors.torch import load_file, save_file

from imglora.util.owned import own_module
from imglora.errors import ModelSourceError
from imglora.families import registry
from imglora.families._shared.singlefile import inspect
from imglora.families._shared.singlefile.inspect import describe
from imglora.families.krea2 import singlefile
from imglora.families.krea2.model import BLOCKS
from imglora.models.source import ModelSource
from imglora.models.tiny import ensure_tiny

REPO = Path(__file__).resolve().parents[3]
UNET = "model.diffusion_model."
# diffusers -> original: prefixes (the first that matches), then names inside the blocks (all)
PREFIXES = (("img_in.", "first."), ("time_embed.linear_1.", "tmlp.0."), ("time_embed.linear_2.", "tmlp.2."),
            ("time_mod_proj.", "tproj.1."), ("txt_in.norm.weight", "txtmlp.0.scale"), ("txt_in.linear_1.", "txtmlp.1."),
            ("txt_in.linear_2.", "txtmlp.3."), ("text_fusion.", "txtfusion."), ("transformer_blocks.", "blocks."),
            ("final_layer.linear.", "last.linear."), ("final_layer.norm.weight", "last.norm.scale"),
            ("final_layer.scale_shift_table", "last.modulation.lin"))
INSIDE = ((".attn.to_q.", ".attn.wq."), (".attn.to_k.", ".attn.wk."), (".attn.to_v.", ".attn.wv."),
          (".attn.to_out.0.", ".attn.wo."), (".attn.to_gate.", ".attn.gate."),
          (".attn.norm_q.weight", ".attn.qknorm.qnorm.scale"), (".attn.norm_k.weight", ".attn.qknorm.knorm.scale"),
          (".ff.", ".mlp."), (".norm1.weight", ".prenorm.scale"), (".norm2.weight", ".postnorm.scale"),
          (".scale_shift_table", ".mod.lin"))


def component(tiny: Path, sub: str) -> dict[str, torch.Tensor]:
    (f,) = (tiny / sub).glob("*.safetensors")
    return load_file(str(f))


def original(tiny: Path) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in component(tiny, "transformer").items():
        name = k
        for new, old in PREFIXES:
            if name.startswith(new):
                name = old + name[len(new):]
                break
        if name.startswith("blocks."):
            for new, old in INSIDE:
                name = name.replace(new, old)
            if name.endswith(".mod.lin"):
                v = v.reshape(-1)  # Krea's blocks keep their six modulation vectors flat
        elif name.startswith("txtfusion."):
            for new, old in INSIDE:
                name = name.replace(new, old)
        out[name] = v
    return out


def write_transformer(tiny: Path, out: Path, *, prefix: str = "", scaled_fp8: bool = False) -> Path:
    """krea2_raw_bf16.safetensors (here: float32), or ComfyUI's fp8_scaled (the blocks' Linear weights as
    weight / scale in float8_e4m3fn with a float32 weight_scale and a comfy_quant marker)."""
    sd = original(tiny)
    if scaled_fp8:
        for k in list(sd):
            if k.startswith("blocks.") and k.endswith(".weight") and sd[k].ndim == 2:
                scale = (sd[k].abs().max() / FP8_MAX).float()
                sd[k] = (sd[k] / scale).to(FP8)
                sd[k[: -len("weight")] + "weight_scale"] = scale.reshape(())
                sd[k[: -len("weight")] + "comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'),
                                                                      dtype=torch.uint8)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({prefix + k: v.contiguous() for k, v in sd.items()}, out)
    return out


def write_qwen3vl(tiny: Path, out: Path, *, bare: bool = False) -> Path:
    """qwen3vl_4b_bf16.safetensors (here: float32): Qwen3VLForConditionalGeneration's names
    (model.language_model.*, model.visual.*), or with ``bare`` model.* and visual.*."""
    sd = component(tiny, "text_encoder")
    lang, vis = ("model.", "visual.") if bare else ("model.language_model.", "model.visual.")
    save_file({(lang + k[len("language_model."):] if k.startswith("language_model.") else vis + k[len("visual."):]): v
               for k, v in sd.items()}, out)
    return out


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_tiny(registry.get("krea2"))


@pytest.fixture
def qwen3vl_as_4b(monkeypatch):
    """The tiny encoder is 16 wide: accepted as Qwen3-VL-4B here (the real one is 2560)."""
    real = inspect.classify
    monkeypatch.setattr(inspect, "classify", lambda r: inspect.Layout(kind="qwen3vl-4b", path=r.path)
                        if any("deepstack_merger_list.0.norm.weight" in k for k in r.keys) else real(r))


def test_the_files_are_told_apart_from_their_headers(tiny: Path, tmp_path: Path) -> None:
    t = describe(write_transformer(tiny, tmp_path / "t.safetensors", prefix=UNET, scaled_fp8=True))
    assert (t.kind, t.prefix, t.fp8, t.scaled) == ("krea2-transformer", UNET, True, True)
    assert describe(write_transformer(tiny, tmp_path / "b.safetensors")).prefix == ""
    for bare in (False, True):
        te = describe(write_qwen3vl(tiny, tmp_path / f"te{bare}.safetensors", bare=bare))
        assert "a Qwen3-VL of width 16" in str(te)
    for width, kind in ((2560, "qwen3vl-4b"), (4096, "qwen3vl-8b")):
        for lang, vis in (("model.language_model.", "model.visual."), ("model.", "visual.")):
            save_file({lang + "embed_tokens.weight": torch.zeros(1, width),
                       lang + "layers.0.self_attn.q_norm.weight": torch.zeros(1),
                       vis + "deepstack_merger_list.0.norm.weight": torch.zeros(1)}, tmp_path / "h.safetensors")
            assert (describe(tmp_path / "h.safetensors").kind, describe(tmp_path / "h.safetensors").prefix) == (kind, lang)
    assert describe(write_qwen_image_vae(tiny, tmp_path / "v.safetensors")).kind == "vae-qwen-image"
    with pytest.raises(ModelSourceError, match=r"t.safetensors is not a FLUX.2 transformer.*krea2-transformer.*"
                                               r"model.family = \"krea2\""):
        inspect.expect(tmp_path / "t.safetensors", "flux2-transformer")


def test_each_file_reads_into_the_folders_model(tiny: Path, tmp_path: Path, qwen3vl_as_4b) -> None:
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers
    from transformers import AutoTokenizer, Qwen3VLModel

    from imglora.families.krea2.model import encode_caption

    want = component(tiny, "transformer")
    for prefix in ("", UNET):
        path = write_transformer(tiny, tmp_path / f"t{len(prefix)}.safetensors", prefix=prefix)
        blocks = []
        model = singlefile.load_transformer(path, tiny, on_block=lambda *a: blocks.append(a[:2]), blocks=BLOCKS)
        assert blocks == [("block", 0), ("block", 1), ("block", 2)]
        got = model.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    theirs = convert_krea2_transformer_checkpoint_to_diffusers(load_file(str(path)))
    assert theirs.keys() == want.keys() and all(torch.equal(theirs[k], want[k]) for k in want)
    folder = own_module(Qwen3VLModel.from_pretrained(tiny, subfolder="text_encoder")).eval()  # (aligned, as imglora reads)
    tokenizer = AutoTokenizer.from_pretrained(tiny, subfolder="tokenizer")
    lang = {k[len("language_model."):]: v for k, v in component(tiny, "text_encoder").items()
            if k.startswith("language_model.")}
    for bare in (False, True):
        src = ModelSource(tiny, {"transformer": path, "vae": write_qwen_image_vae(tiny, tmp_path / "v.safetensors"),
                                 "text_encoder": write_qwen3vl(tiny, tmp_path / f"te{bare}.safetensors", bare=bare)})
        encoder = singlefile.load_text_encoder(src, torch.float32)
        te = encoder.state_dict()
        assert te.keys() == lang.keys() and all(torch.equal(te[k], lang[k]) for k in lang)
    with torch.no_grad():  # the language model alone gives the caption the states the whole Qwen3VLModel gives
        assert torch.equal(encode_caption(tokenizer, encoder, "a red cube on grass", 64),
                           encode_caption(tokenizer, folder, "a red cube on grass", 64))
    vae = singlefile.load_vae(src, torch.float32).state_dict()
    want = component(tiny, "vae")
    assert vae.keys() == want.keys() and all(torch.equal(vae[k], want[k]) for k in want)
    base = singlefile.base_weights(src, "transformer", ["transformer_blocks.2.attn.to_gate"])
    assert torch.equal(base["transformer_blocks.2.attn.to_gate"],
                       component(tiny, "transformer")["transformer_blocks.2.attn.to_gate.weight"])


def test_a_scaled_fp8_file_is_its_stored_values_times_their_scale(tiny: Path, tmp_path: Path) -> None:
    """Dequantised exactly as fp8 · scale: the weight within e4m3's rounding (relative 2⁻⁴, plus half
    its smallest step, 2⁻¹⁰ · scale, below its normal range)."""
    path = write_transformer(tiny, tmp_path / "t.safetensors", scaled_fp8=True)
    got = singlefile.load_transformer(path, tiny, blocks=BLOCKS).state_dict()
    stored = load_file(str(path))
    w, scale = stored["blocks.1.mlp.up.weight"], stored["blocks.1.mlp.up.weight_scale"]
    assert w.dtype == FP8 and torch.equal(got["transformer_blocks.1.ff.up.weight"], w.float() * scale)
    want = component(tiny, "transformer")
    step = max(float(t.abs().max()) for t in want.values()) / FP8_MAX * 2 ** -10
    for k, t in want.items():
        assert bool(((got[k] - t).abs() <= t.abs() * 2 ** -4 + step).all()), k


def test_a_missing_or_unknown_key_names_the_file_and_the_key(tiny: Path, tmp_path: Path) -> None:
    sd = original(tiny)
    save_file({k: v for k, v in sd.items() if k != "blocks.2.mod.lin"}, tmp_path / "gone.safetensors")
    with pytest.raises(ModelSourceError, match=r"gone.safetensors: the Krea 2 transformer does not fit .*1 missing: "
                                               r"transformer_blocks.2.scale_shift_table"):
        singlefile.load_transformer(tmp_path / "gone.safetensors", tiny, blocks=BLOCKS)
    save_file({**sd, "blocks.0.mod.lin": torch.zeros(7)}, tmp_path / "odd.safetensors")
    with pytest.raises(ModelSourceError, match=r"odd.safetensors: .*1 with another shape: "
                                               r"transformer_blocks.0.scale_shift_table \(file \[7\], model \[6, 32\]\)"):
        singlefile.load_transformer(tmp_path / "odd.safetensors", tiny, blocks=BLOCKS)


def preset(tmp_path: Path, sample_dataset: Path, *extra: str):
    from imglora.commands.common import load_config

    q = json.dumps
    return load_config(REPO / "presets" / "tiny-krea2.toml", [
        f"data.dir={q(str(sample_dataset))}", f"cache.dir={q(str(tmp_path / 'cache'))}",
        f"run.output_dir={q(str(tmp_path / 'runs'))}", "train.max_steps=2", "train.warmup_steps=0",
        "train.log_every=1", "train.checkpoint_every=0", *extra])


def comfyui(tiny: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    import shutil

    d = tmp_path / "files"
    d.mkdir()
    comfy = make_comfyui_tree(tmp_path / "ComfyUI", {
        "models/diffusion_models/krea2_raw_fp32.safetensors": write_transformer(tiny, d / "t.safetensors"),
        "models/text_encoders/qwen3vl_4b_fp32.safetensors": write_qwen3vl(tiny, d / "te.safetensors"),
        "models/vae/qwen_image_vae.safetensors": write_qwen_image_vae(tiny, d / "v.safetensors")})
    shutil.copytree(tiny / "tokenizer", comfy / "comfy" / "text_encoders" / "qwen25_tokenizer")
    return comfy, [f"model.comfyui={json.dumps(str(comfy))}", 'model.path="krea2_raw_fp32.safetensors"',
                   'model.text_encoder="qwen3vl_4b_fp32.safetensors"', 'model.vae="qwen_image_vae.safetensors"']


def test_the_shipped_krea_2_raw_configs_and_comfyuis_tokenizer_are_used(tiny: Path, tmp_path: Path,
                                                                         sample_dataset: Path, qwen3vl_as_4b,
                                                                         monkeypatch) -> None:
    from imglora.families._shared.singlefile import configdir
    from imglora.models.resolve import resolve_model

    family = registry.get("krea2")
    monkeypatch.setattr(configdir, "hub_snapshot", lambda repo: None)  # an empty Hugging Face cache
    monkeypatch.setenv("IMGLORA_HOME", str(tmp_path / "home"))
    _, names = comfyui(tiny, tmp_path)
    src = resolve_model(preset(tmp_path, sample_dataset, *names).model, family)
    t = json.loads((src.root / "transformer" / "config.json").read_text())
    assert (t["num_layers"], set(src.files)) == (28, {"transformer", "text_encoder", "vae"})
    assert (src.root / "tokenizer" / "vocab.json").is_file()
    with pytest.raises(ModelSourceError, match=r"is a Krea 2 transformer alone; Krea 2 also needs Qwen3-VL-4B and "
                                               r"Qwen-Image's VAE as files: set model.vae \(e.g. qwen_image_vae"):
        resolve_model(preset(tmp_path, sample_dataset, *names[:3]).model, family)


@pytest.mark.slow  # (two short runs: about 3 s on 2 cores)
def test_training_from_comfyuis_files_is_training_from_the_folder(tiny: Path, tmp_path: Path, sample_dataset: Path,
                                                                  qwen3vl_as_4b, monkeypatch) -> None:
    from test_qwen_image_files import assert_same_training

    _, names = comfyui(tiny, tmp_path)
    monkeypatch.setenv("IMGLORA_HOME", str(tmp_path / "home"))
    assert_same_training(preset(tmp_path, sample_dataset, "run.name=folder"),
                         preset(tmp_path, sample_dataset, "run.name=files", *names,
                                f"model.config={json.dumps(str(tiny))}"))

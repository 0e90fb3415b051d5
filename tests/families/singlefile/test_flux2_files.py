"""FLUX.2 from the single files ComfyUI users have: the transformer in BFL's layout (q, k and v fused,
norm scales, the final adaLN's halves as BFL orders them; bare or under model.diffusion_model.; fp32
or ComfyUI's scaled fp8), flux2-vae.safetensors (LDM names, the quant convs inside the encoder and
decoder, the bn statistics) and Qwen3 in Hugging Face's names, each read into exactly the model the
diffusers folder gives (and the transformer as diffusers' own converter reads it); the files are told
apart from their headers, the model's size from its shapes; training from them is training from the
folder.

The writers below turn the tiny diffusers model into those layouts from tables written here in the
diffusers -> BFL direction (never through imglora's loaders), after BFL's flux2 module tree and
diffusers' convert_flux2_transformer_checkpoint_to_diffusers / scripts/convert_flux2_to_diffusers.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from layouts import FP8, FP8_MAX, make_comfyui_tree, vae_diffusers_to_ldm
from safetensors.torch import load_file, save_file

from imglora.errors import ModelSourceError
from imglora.families import registry
from imglora.families._shared.singlefile import inspect
from imglora.families._shared.singlefile.inspect import describe, expect
from imglora.families.flux2 import singlefile
from imglora.families.flux2.model import BLOCKS
from imglora.models.source import ModelSource
from imglora.models.tiny import ensure_tiny

REPO = Path(__file__).resolve().parents[3]
UNET = "model.diffusion_model."

# diffusers -> BFL
TOP = {"x_embedder": "img_in", "context_embedder": "txt_in",
       "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
       "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
       "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
       "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
       "single_stream_modulation.linear": "single_stream_modulation.lin", "proj_out": "final_layer.linear",
       "norm_out.linear": "final_layer.adaLN_modulation.1"}
DOUBLE = {"attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
          "attn.to_out.0": "img_attn.proj", "ff.linear_in": "img_mlp.0", "ff.linear_out": "img_mlp.2",
          "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm",
          "attn.to_add_out": "txt_attn.proj", "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2"}
QKV = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
       "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2", "attn.norm_q": "norm.query_norm",
          "attn.norm_k": "norm.key_norm"}


def component(tiny: Path, sub: str) -> dict[str, torch.Tensor]:
    (f,) = (tiny / sub).glob("*.safetensors")
    return load_file(str(f))


def bfl_transformer(tiny: Path) -> dict[str, torch.Tensor]:
    sd = component(tiny, "transformer")
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        stem, suffix = k.rsplit(".", 1)
        parts = stem.split(".")
        if stem in TOP:
            name = TOP[stem]
            if stem == "norm_out.linear":
                scale, shift = v.chunk(2)  # diffusers [scale; shift] -> BFL [shift; scale]
                v = torch.cat([shift, scale])
        elif parts[0] == "transformer_blocks":
            rest = ".".join(parts[2:])
            if any(rest in names for names in QKV.values()):
                bfl, names = next((b, n) for b, n in QKV.items() if rest in n)
                if rest != names[0]:
                    continue
                pre = f"transformer_blocks.{parts[1]}."
                v = torch.cat([sd[f"{pre}{n}.{suffix}"] for n in names])
                name = f"double_blocks.{parts[1]}.{bfl}"
            else:
                name = f"double_blocks.{parts[1]}.{DOUBLE[rest]}"
        else:
            assert parts[0] == "single_transformer_blocks", k
            name = f"single_blocks.{parts[1]}.{SINGLE['.'.join(parts[2:])]}"
        out[f"{name}.{'scale' if 'norm' in name.rsplit('.', 1)[-1] else suffix}"] = v
    return out


def write_transformer(tiny: Path, out: Path, *, prefix: str = "", scaled_fp8: bool = False) -> Path:
    """flux-2-klein-base-4b.safetensors (here: the tiny model's float32), or with ``scaled_fp8`` ComfyUI's
    mixed fp8 (each block's Linear weight as weight / scale in float8_e4m3fn, a float32 ``weight_scale``
    and a ``comfy_quant`` marker; the rest as it is)."""
    bfl = bfl_transformer(tiny)
    if scaled_fp8:
        for k in list(bfl):
            if k.startswith(("double_blocks.", "single_blocks.")) and k.endswith(".weight") and bfl[k].ndim == 2:
                scale = (bfl[k].abs().max() / FP8_MAX).float()
                stem = k[: -len("weight")]
                bfl[k] = (bfl[k] / scale).to(FP8)
                bfl[stem + "weight_scale"] = scale.reshape(())
                bfl[stem + "comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({prefix + k: v.contiguous() for k, v in bfl.items()}, out)
    return out


def write_vae(tiny: Path, out: Path) -> Path:
    """flux2-vae.safetensors: LDM names with BFL's encoder.quant_conv / decoder.post_quant_conv, bn.*."""
    sd = component(tiny, "vae")
    table = vae_diffusers_to_ldm(json.loads((tiny / "vae" / "config.json").read_text()))
    moved = {"quant_conv.": "encoder.quant_conv.", "post_quant_conv.": "decoder.post_quant_conv."}
    bfl = {}
    for k, v in sd.items():
        if k.startswith("bn."):
            bfl[k] = v  # running_mean, running_var and num_batches_tracked (int64), as BFL's BatchNorm2d saves them
            continue
        name = table[k]
        if ".mid_block.attentions.0." in k and k.endswith(".weight") and v.ndim == 2:
            v = v[:, :, None, None]
        for old, new in moved.items():
            if name.startswith(old):
                name = new + name[len(old):]
        bfl[name] = v
    save_file({k: v.contiguous() for k, v in bfl.items()}, out)
    return out


def write_qwen3(tiny: Path, out: Path) -> Path:
    """qwen_3_4b.safetensors: Qwen3ForCausalLM's names (the tiny folder's), with its tied LM head."""
    sd = component(tiny, "text_encoder")
    save_file({**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()}, out)
    return out


def header_only(out: Path, tensors: dict[str, tuple[int, ...]]) -> Path:
    """A file with these keys and shapes (zeros): what describe() reads of a real one."""
    save_file({k: torch.zeros(s) for k, s in tensors.items()}, out)
    return out


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_tiny(registry.get("flux2"))


@pytest.fixture
def qwen3_as_4b(monkeypatch):
    """The tiny encoder is 16 wide: accepted as Qwen3-4B here (the real one is 2560)."""
    real = inspect.classify
    monkeypatch.setattr(inspect, "classify", lambda r: inspect.Layout(kind="qwen3-4b", path=r.path)
                        if "model.layers.0.self_attn.q_norm.weight" in r.key_set else real(r))


def test_the_files_and_the_models_size_are_told_apart_from_their_headers(tiny: Path, tmp_path: Path) -> None:
    t = describe(write_transformer(tiny, tmp_path / "t.safetensors", prefix=UNET, scaled_fp8=True))
    assert (t.kind, t.prefix, t.fp8, t.scaled, t.variant) == ("flux2-transformer", UNET, True, True, None)
    assert "txt_in takes 48 features" in t.note
    for width, variant in ((7680, "klein-4b"), (12288, "klein-9b"), (15360, "dev")):
        f = header_only(tmp_path / f"{variant}.safetensors", {"double_stream_modulation_img.lin.weight": (1,),
                                                              "txt_in.weight": (1, width)})
        assert (describe(f).kind, describe(f).variant) == ("flux2-transformer", variant)
    assert describe(write_vae(tiny, tmp_path / "vae.safetensors")).kind == "vae-flux2"
    assert "a Qwen3 text encoder of width 16" in str(describe(write_qwen3(tiny, tmp_path / "te.safetensors")))
    for width, kind in ((2560, "qwen3-4b"), (4096, "qwen3-8b")):
        f = header_only(tmp_path / f"{kind}.safetensors", {"model.embed_tokens.weight": (1, width),
                                                           "model.layers.0.self_attn.q_norm.weight": (1,)})
        assert describe(f).kind == kind
    with pytest.raises(ModelSourceError, match=r"t.safetensors is not a FLUX.1 transformer.*flux2-transformer.*"
                                               r"model.family = \"flux2\""):
        expect(tmp_path / "t.safetensors", "flux-transformer")


def test_each_file_reads_into_the_folders_model(tiny: Path, tmp_path: Path, qwen3_as_4b) -> None:
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    want = component(tiny, "transformer")
    for prefix in ("", UNET):
        path = write_transformer(tiny, tmp_path / f"t{len(prefix)}.safetensors", prefix=prefix)
        blocks = []
        model = singlefile.load_transformer(path, tiny, on_block=lambda *a: blocks.append(a[:2]), blocks=BLOCKS)
        assert blocks == [("double", 0), ("double", 1), ("single", 0), ("single", 1)]
        got = model.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # diffusers' own reading of BFL's layout (which needs the prefix stripped) gives the same tensors
    theirs = convert_flux2_transformer_checkpoint_to_diffusers(load_file(str(tmp_path / "t0.safetensors")))
    assert theirs.keys() == want.keys() and all(torch.equal(theirs[k], want[k]) for k in want)
    src = ModelSource(tiny, {"transformer": path, "text_encoder": write_qwen3(tiny, tmp_path / "te.safetensors"),
                             "vae": write_vae(tiny, tmp_path / "vae.safetensors")})
    te = singlefile.load_text_encoder(src, torch.float32).state_dict()
    want = {k.removeprefix("model."): v for k, v in component(tiny, "text_encoder").items()}
    assert te.keys() == want.keys() and all(torch.equal(te[k], want[k]) for k in want)
    vae = singlefile.load_vae(src, torch.float32).state_dict()
    want = component(tiny, "vae")
    assert vae.keys() == want.keys() and all(torch.equal(vae[k], want[k]) for k in want)
    # the DoRA export's base weights: q as its rows of the fused qkv
    base = singlefile.base_weights(src, "transformer", ["transformer_blocks.1.attn.add_v_proj"])
    assert torch.equal(base["transformer_blocks.1.attn.add_v_proj"],
                       component(tiny, "transformer")["transformer_blocks.1.attn.add_v_proj.weight"])


def test_a_scaled_fp8_file_is_its_stored_values_times_their_scale(tiny: Path, tmp_path: Path) -> None:
    """Dequantised exactly as fp8 · scale, which is the bf16 weight within fp8's rounding: e4m3 keeps 3
    mantissa bits (relative error ≤ 2⁻⁴), and values below its normal range are within half its
    smallest step (2⁻¹⁰ · scale)."""
    path = write_transformer(tiny, tmp_path / "t.safetensors", scaled_fp8=True)
    got = singlefile.load_transformer(path, tiny, blocks=BLOCKS).state_dict()
    stored = load_file(str(path))
    qkv, scale = stored["double_blocks.1.txt_attn.qkv.weight"], stored["double_blocks.1.txt_attn.qkv.weight_scale"]
    assert qkv.dtype == FP8
    assert torch.equal(got["transformer_blocks.1.attn.add_k_proj.weight"], (qkv.float() * scale).chunk(3)[1])
    want = component(tiny, "transformer")
    step = max(float(w.abs().max()) for w in want.values()) / FP8_MAX * 2 ** -10  # ≥ half of any scale's step
    for k, w in want.items():
        assert bool(((got[k] - w).abs() <= w.abs() * 2 ** -4 + step).all()), k


def test_a_missing_or_unknown_key_names_the_file_and_the_key(tiny: Path, tmp_path: Path) -> None:
    bfl = bfl_transformer(tiny)
    gone = {k: v for k, v in bfl.items() if k != "single_blocks.1.linear2.weight"}
    save_file(gone, tmp_path / "gone.safetensors")
    with pytest.raises(ModelSourceError, match=r"gone.safetensors: the FLUX.2 transformer does not fit .*1 missing: "
                                               r"single_transformer_blocks.1.attn.to_out.weight"):
        singlefile.load_transformer(tmp_path / "gone.safetensors", tiny, blocks=BLOCKS)
    save_file({**bfl, "double_blocks.0.img_attn.extra.weight": torch.zeros(2)}, tmp_path / "odd.safetensors")
    with pytest.raises(ModelSourceError, match=r"odd.safetensors: .*1 unexpected: double_blocks.0.img_attn.extra.weight"):
        singlefile.load_transformer(tmp_path / "odd.safetensors", tiny, blocks=BLOCKS)
    vae = load_file(str(write_vae(tiny, tmp_path / "vae.safetensors")))
    save_file({k: v for k, v in vae.items() if k != "decoder.post_quant_conv.bias"}, tmp_path / "vae2.safetensors")
    with pytest.raises(ModelSourceError, match=r"vae2.safetensors: the FLUX.2 VAE does not fit .*missing: "
                                               r"post_quant_conv.bias"):
        singlefile.load_vae(ModelSource(tiny, {"vae": tmp_path / "vae2.safetensors"}), torch.float32)


def preset(tmp_path: Path, sample_dataset: Path, *extra: str):
    from imglora.commands.common import load_config

    q = json.dumps
    return load_config(REPO / "presets" / "tiny-flux2.toml", [
        f"data.dir={q(str(sample_dataset))}", f"cache.dir={q(str(tmp_path / 'cache'))}",
        f"run.output_dir={q(str(tmp_path / 'runs'))}", "train.max_steps=2", "train.warmup_steps=0",
        "train.log_every=1", "train.checkpoint_every=0", *extra])


def test_the_shipped_configs_follow_the_files_size_and_dev_reads_comfyuis_mistral(
        tiny: Path, tmp_path: Path, sample_dataset: Path, monkeypatch) -> None:
    from imglora.families._shared.singlefile import configdir
    from imglora.models.resolve import resolve_model

    family = registry.get("flux2")
    monkeypatch.setattr(configdir, "hub_snapshot", lambda repo: None)  # an empty Hugging Face cache
    monkeypatch.setenv("IMGLORA_HOME", str(tmp_path / "home"))
    d = tmp_path / "files"
    d.mkdir()
    files = {f"models/diffusion_models/{v}.safetensors": header_only(
        d / f"{v}.safetensors", {"double_stream_modulation_img.lin.weight": (1,), "txt_in.weight": (1, w)})
        for w, v in ((7680, "klein-4b"), (12288, "klein-9b"), (15360, "dev"))}
    files.update({f"models/text_encoders/{k}.safetensors": header_only(
        d / f"{k}.safetensors", {"model.embed_tokens.weight": (1, w), "model.layers.0.self_attn.q_norm.weight": (1,)})
        for w, k in ((2560, "qwen3-4b"), (4096, "qwen3-8b"))})
    files["models/vae/flux2-vae.safetensors"] = write_vae(tiny, d / "vae.safetensors")
    comfy = make_comfyui_tree(tmp_path / "ComfyUI", files)
    (comfy / "comfy" / "text_encoders" / "qwen25_tokenizer").mkdir(parents=True)
    import shutil

    shutil.copytree(tiny / "tokenizer", comfy / "comfy" / "text_encoders" / "qwen25_tokenizer", dirs_exist_ok=True)

    def resolved(path: str, te: str = "", *extra: str):
        keys = [f"model.comfyui={json.dumps(str(comfy))}", f'model.path="{path}.safetensors"',
                'model.vae="flux2-vae.safetensors"', *([f'model.text_encoder="{te}.safetensors"'] if te else []), *extra]
        return resolve_model(preset(tmp_path, sample_dataset, *keys).model, family)

    for variant, te, layers, width in (("klein-4b", "qwen3-4b", 5, 2560), ("klein-9b", "qwen3-8b", 8, 4096)):
        src = resolved(variant, te)
        t = json.loads((src.root / "transformer" / "config.json").read_text())
        e = json.loads((src.root / "text_encoder" / "config.json").read_text())
        assert (t["num_layers"], e["hidden_size"], set(src.files)) == (layers, width, {"transformer", "text_encoder",
                                                                                         "vae"})
        assert (src.root / "tokenizer" / "vocab.json").is_file()
    with pytest.raises(ModelSourceError, match=r"qwen3-4b.safetensors is not Qwen3-8B.*it looks like qwen3-4b"):
        resolved("klein-9b", "qwen3-4b")
    with pytest.raises(ModelSourceError, match=r"is a FLUX.2 transformer alone; FLUX.2 also needs Qwen3-4B and its "
                                               r"VAE as files: set model.text_encoder \(e.g. qwen_3_4b.safetensors\)"):
        resolved("klein-4b")
    # [dev]: Comfy-Org's Mistral-Small-3 file (detect_te_model's test: width 5120, no q_norm), its tokenizer and
    # chat template from FLUX.2 [dev]'s tokenizer/ in the Hugging Face cache; or Mistral from model.config's folder
    files["models/text_encoders/mistral_3_small_flux2_bf16.safetensors"] = header_only(
        d / "mistral.safetensors", {"model.embed_tokens.weight": (1, 5120),
                                    "model.layers.0.post_attention_layernorm.weight": (5120,)})
    comfy = make_comfyui_tree(tmp_path / "ComfyUI2", files)
    with pytest.raises(ModelSourceError, match=r"qwen3-4b.safetensors is not Mistral-Small-3 \(24B\), FLUX.2 \[dev\]'s "
                                               r"text encoder"):
        resolved("dev", "qwen3-4b")
    with pytest.raises(ModelSourceError, match=r"dev.safetensors is a FLUX.2 transformer alone; FLUX.2 also needs "
                                               r"Mistral-Small-3 and its VAE as files: set model.text_encoder \(e.g. "
                                               r"mistral_3_small_flux2_bf16.safetensors\) \(or, for the text encoder, "
                                               r"model.config to the FLUX.2 \[dev\] diffusers folder"):
        resolved("dev")
    with pytest.raises(ModelSourceError, match=r"FLUX.2 \[dev\]'s Mistral-Small-3's tokenizer is not on this machine.*"
                                               r"`hf download black-forest-labs/FLUX.2-dev --include 'tokenizer/\*'`"
                                               r".*or set model.config .*gated.*tekken"):
        resolved("dev", "mistral_3_small_flux2_bf16")
    snapshot = tmp_path / "hub-flux2-dev"
    shutil.copytree(tiny / "tokenizer", snapshot / "tokenizer")  # (a tokenizer.json: what is looked for)
    monkeypatch.setattr(configdir, "hub_snapshot", lambda repo: snapshot if repo == "black-forest-labs/FLUX.2-dev"
                        else None)
    src = resolved("dev", "mistral_3_small_flux2_bf16")
    e = json.loads((src.root / "text_encoder" / "config.json").read_text())
    assert (e["model_type"], e["text_config"]["num_hidden_layers"]) == ("mistral3", 40)
    assert set(src.files) == {"transformer", "text_encoder", "vae"} and (src.root / "tokenizer" / "tokenizer.json").is_file()
    src = resolved("dev", "", f"model.config={json.dumps(str(tiny))}")
    assert src.root == tiny and set(src.files) == {"transformer", "vae"}


@pytest.mark.slow  # (two short runs: about 3 s on 2 cores)
def test_training_from_comfyuis_files_is_training_from_the_folder(tiny: Path, tmp_path: Path, sample_dataset: Path,
                                                                  qwen3_as_4b, monkeypatch) -> None:
    from test_qwen_image_files import assert_same_training

    d = tmp_path / "files"
    d.mkdir()
    comfy = make_comfyui_tree(tmp_path / "ComfyUI", {
        "models/diffusion_models/flux-2-klein-fp32.safetensors": write_transformer(tiny, d / "t.safetensors"),
        "models/text_encoders/qwen_3_4b.safetensors": write_qwen3(tiny, d / "te.safetensors"),
        "models/vae/flux2-vae.safetensors": write_vae(tiny, d / "vae.safetensors")})
    names = [f"model.comfyui={json.dumps(str(comfy))}", 'model.path="flux-2-klein-fp32.safetensors"',
             'model.text_encoder="qwen_3_4b.safetensors"', 'model.vae="flux2-vae.safetensors"',
             f"model.config={json.dumps(str(tiny))}"]
    monkeypatch.setenv("IMGLORA_HOME", str(tmp_path / "home"))
    assert_same_training(preset(tmp_path, sample_dataset, "run.name=folder"),
                         preset(tmp_path, sample_dataset, "run.name=files", *names))

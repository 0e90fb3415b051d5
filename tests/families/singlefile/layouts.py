"""Test-side writers of the ORIGINAL single-file layouts, made from a tiny diffusers folder.

These files stand in for what users download (sd_xl_base_1.0.safetensors, sdxl_vae.safetensors,
flux1-dev.safetensors, flux1-dev-fp8.safetensors, clip_l.safetensors, t5xxl_fp16 / _fp8_e4m3fn,
ae.safetensors) and for a ComfyUI folder holding them. They are written from the published key
tables, read in the diffusers -> original direction, and never through imglora's own loaders: a
loader bug therefore cannot cancel out against the same bug here.

Sources of the tables:

* UNet: ComfyUI ``comfy/utils.py::unet_to_diffusers`` (diffusers key -> LDM key, generic over the
  number of levels, resnets per level and transformer depths).
* VAE: diffusers ``single_file_utils.py`` ``DIFFUSERS_TO_LDM_MAPPING["vae"]`` and
  ``convert_ldm_vae_checkpoint`` read backwards (decoder ``up`` index reversed, attention q/k/v/proj
  stored as 1x1 convolutions as in LDM's and BFL's ``AttnBlock``).
* OpenCLIP bigG: diffusers ``DIFFUSERS_TO_LDM_MAPPING["openclip"]`` / ComfyUI
  ``clip_text_transformers_convert`` read backwards (q,k,v stacked into ``in_proj``; the projection
  stored as OpenCLIP's ``x @ P`` matrix, i.e. the transpose of the Linear weight).
* FLUX: ComfyUI ``comfy/utils.py::flux_to_diffusers`` (diffusers key -> (BFL key, row offset,
  rows)), kohya ``flux_utils.convert_diffusers_sd_to_bfl`` (concatenate; swap the final adaLN halves).

Weights keep the tiny folder's dtype (float32) unless the real file's name fixes it (t5xxl_fp16,
the fp8 variants), so tests can compare loaded weights with ``torch.equal``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
UNET_PREFIX = "model.diffusion_model."  # ComfyUI's prefix of a diffusion model's keys

# --------------------------------------------------------------------------------------------
# reading the tiny diffusers folder
# --------------------------------------------------------------------------------------------


def _component(diffusers_dir: Path, sub: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    folder = Path(diffusers_dir) / sub
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 1, f"expected one weights file in {folder}, found {files}"
    return load_file(files[0]), json.loads((folder / "config.json").read_text())


def _save(tensors: dict[str, torch.Tensor], out_file: Path, metadata: dict[str, str] | None = None) -> Path:
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_file, metadata=metadata)
    return out_file


# --------------------------------------------------------------------------------------------
# SDXL UNet (LDM layout), after ComfyUI unet_to_diffusers
# --------------------------------------------------------------------------------------------

_RESNET = {"in_layers.0": "norm1", "in_layers.2": "conv1", "emb_layers.1": "time_emb_proj",
           "out_layers.0": "norm2", "out_layers.3": "conv2", "skip_connection": "conv_shortcut"}
_TRANSFORMER_BLOCK = ("norm1", "norm2", "norm3", "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                      "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ff.net.0.proj", "ff.net.2")


def unet_diffusers_to_ldm(config: dict[str, Any]) -> dict[str, str]:
    """diffusers UNet key -> LDM key (without ``model.diffusion_model.``) for an SDXL-shaped config.

    Keys that do not exist in the model (e.g. the absent biases of to_q/to_k/to_v, or conv_shortcut
    where channels do not change) are in the map too; the caller only looks up real keys.
    """
    levels = len(config["block_out_channels"])
    per_level = config["layers_per_block"]
    depth = config["transformer_layers_per_block"]
    depth = [depth] * levels if isinstance(depth, int) else list(depth)
    attn_down = [t.startswith("CrossAttn") for t in config["down_block_types"]]
    attn_up = [t.startswith("CrossAttn") for t in config["up_block_types"]]
    out: dict[str, str] = {}

    def both(d: str, ldm: str) -> None:
        for e in ("weight", "bias"):
            out[f"{d}.{e}"] = f"{ldm}.{e}"

    def resnet(d: str, ldm: str) -> None:
        for ldm_name, d_name in _RESNET.items():
            both(f"{d}.{d_name}", f"{ldm}.{ldm_name}")

    def transformer(d: str, ldm: str, n: int) -> None:
        for name in ("norm", "proj_in", "proj_out"):
            both(f"{d}.{name}", f"{ldm}.{name}")
        for t in range(n):
            for name in _TRANSFORMER_BLOCK:
                both(f"{d}.transformer_blocks.{t}.{name}", f"{ldm}.transformer_blocks.{t}.{name}")

    for x in range(levels):
        n = 1 + (per_level + 1) * x
        for i in range(per_level):
            resnet(f"down_blocks.{x}.resnets.{i}", f"input_blocks.{n + i}.0")
            if attn_down[x]:
                transformer(f"down_blocks.{x}.attentions.{i}", f"input_blocks.{n + i}.1", depth[x])
        if x < levels - 1:
            both(f"down_blocks.{x}.downsamplers.0.conv", f"input_blocks.{n + per_level}.0.op")
    resnet("mid_block.resnets.0", "middle_block.0")
    transformer("mid_block.attentions.0", "middle_block.1", depth[-1])
    resnet("mid_block.resnets.1", "middle_block.2")
    up_depth = depth[::-1]
    for x in range(levels):
        for i in range(per_level + 1):
            n = (per_level + 1) * x + i
            resnet(f"up_blocks.{x}.resnets.{i}", f"output_blocks.{n}.0")
            if attn_up[x]:
                transformer(f"up_blocks.{x}.attentions.{i}", f"output_blocks.{n}.1", up_depth[x])
            if i == per_level and x < levels - 1:
                both(f"up_blocks.{x}.upsamplers.0.conv", f"output_blocks.{n}.{2 if attn_up[x] else 1}.conv")
    for d, ldm in (("conv_in", "input_blocks.0.0"), ("time_embedding.linear_1", "time_embed.0"),
                   ("time_embedding.linear_2", "time_embed.2"), ("add_embedding.linear_1", "label_emb.0.0"),
                   ("add_embedding.linear_2", "label_emb.0.2"), ("conv_norm_out", "out.0"), ("conv_out", "out.2")):
        both(d, ldm)
    return out


def _unet_ldm(diffusers_dir: Path) -> dict[str, torch.Tensor]:
    sd, config = _component(diffusers_dir, "unet")
    table = unet_diffusers_to_ldm(config)
    return {table[k]: v for k, v in sd.items()}


# --------------------------------------------------------------------------------------------
# VAE (LDM / BFL layout)
# --------------------------------------------------------------------------------------------


def vae_diffusers_to_ldm(config: dict[str, Any]) -> dict[str, str]:
    """diffusers AutoencoderKL key -> LDM key, as diffusers' DIFFUSERS_TO_LDM_MAPPING['vae'] +
    convert_ldm_vae_checkpoint, read backwards."""
    levels = len(config["block_out_channels"])
    per_level = config["layers_per_block"]
    resnet = {"norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2",
              "conv_shortcut": "nin_shortcut"}
    attn = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
    out: dict[str, str] = {}
    for e in ("weight", "bias"):
        for part in ("encoder", "decoder"):
            out[f"{part}.conv_in.{e}"] = f"{part}.conv_in.{e}"
            out[f"{part}.conv_out.{e}"] = f"{part}.conv_out.{e}"
            out[f"{part}.conv_norm_out.{e}"] = f"{part}.norm_out.{e}"
            for j in (0, 1):
                for d, ldm in resnet.items():
                    out[f"{part}.mid_block.resnets.{j}.{d}.{e}"] = f"{part}.mid.block_{j + 1}.{ldm}.{e}"
            for d, ldm in attn.items():
                out[f"{part}.mid_block.attentions.0.{d}.{e}"] = f"{part}.mid.attn_1.{ldm}.{e}"
        out[f"quant_conv.{e}"] = f"quant_conv.{e}"
        out[f"post_quant_conv.{e}"] = f"post_quant_conv.{e}"
        for i in range(levels):
            for j in range(per_level):
                for d, ldm in resnet.items():
                    out[f"encoder.down_blocks.{i}.resnets.{j}.{d}.{e}"] = f"encoder.down.{i}.block.{j}.{ldm}.{e}"
            if i < levels - 1:
                out[f"encoder.down_blocks.{i}.downsamplers.0.conv.{e}"] = f"encoder.down.{i}.downsample.conv.{e}"
            ldm_i = levels - 1 - i  # LDM numbers decoder levels from the lowest resolution up
            for j in range(per_level + 1):
                for d, ldm in resnet.items():
                    out[f"decoder.up_blocks.{i}.resnets.{j}.{d}.{e}"] = f"decoder.up.{ldm_i}.block.{j}.{ldm}.{e}"
            if i < levels - 1:
                out[f"decoder.up_blocks.{i}.upsamplers.0.conv.{e}"] = f"decoder.up.{ldm_i}.upsample.conv.{e}"
    return out


def _vae_ldm(diffusers_dir: Path) -> dict[str, torch.Tensor]:
    sd, config = _component(diffusers_dir, "vae")
    table = vae_diffusers_to_ldm(config)
    out = {}
    for k, v in sd.items():
        if ".mid_block.attentions.0." in k and k.endswith(".weight") and v.ndim == 2:
            v = v[:, :, None, None]  # LDM's AttnBlock uses 1x1 convolutions
        out[table[k]] = v
    return out


# --------------------------------------------------------------------------------------------
# CLIP text encoders
# --------------------------------------------------------------------------------------------


def _hf_clip_keys(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers CLIP state dict with the ``text_model.`` prefix the released files use
    (transformers 5 saves CLIPTextModel without it) and CLIP's ``position_ids`` buffer."""
    out = {k if k.startswith(("text_model.", "text_projection")) else f"text_model.{k}": v for k, v in sd.items()}
    n = out["text_model.embeddings.position_embedding.weight"].shape[0]
    out["text_model.embeddings.position_ids"] = torch.arange(n, dtype=torch.int64)[None]
    return out


def _open_clip(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CLIPTextModelWithProjection state dict -> OpenCLIP text tower keys (SGM's embedders.1.model)."""
    p = "text_model."
    out = {"token_embedding.weight": sd[p + "embeddings.token_embedding.weight"],
           "positional_embedding": sd[p + "embeddings.position_embedding.weight"],
           "ln_final.weight": sd[p + "final_layer_norm.weight"],
           "ln_final.bias": sd[p + "final_layer_norm.bias"],
           "text_projection": sd["text_projection.weight"].T.contiguous(),  # OpenCLIP: x @ P
           "logit_scale": torch.tensor(4.6052)}
    layers = {int(k.split(".")[3]) for k in sd if k.startswith(p + "encoder.layers.")}
    for i in sorted(layers):
        s, t = f"{p}encoder.layers.{i}.", f"transformer.resblocks.{i}."
        for e in ("weight", "bias"):
            out[f"{t}attn.in_proj_{e}"] = torch.cat([sd[f"{s}self_attn.{q}_proj.{e}"] for q in "qkv"])
            out[f"{t}attn.out_proj.{e}"] = sd[f"{s}self_attn.out_proj.{e}"]
            out[f"{t}ln_1.{e}"] = sd[f"{s}layer_norm1.{e}"]
            out[f"{t}ln_2.{e}"] = sd[f"{s}layer_norm2.{e}"]
            out[f"{t}mlp.c_fc.{e}"] = sd[f"{s}mlp.fc1.{e}"]
            out[f"{t}mlp.c_proj.{e}"] = sd[f"{s}mlp.fc2.{e}"]
    return out


# --------------------------------------------------------------------------------------------
# public writers
# --------------------------------------------------------------------------------------------


def write_sgm_sdxl(diffusers_dir: Path, out_file: Path, *, vae: bool = True, v_pred: bool = False,
                   metadata: dict[str, str] | None = None) -> Path:
    """One file as sd_xl_base_1.0.safetensors: SGM prefixes around the LDM UNet, HF CLIP-L,
    OpenCLIP bigG and the LDM VAE; ComfyUI's empty ``v_pred`` key for v-prediction finetunes."""
    tensors = {f"model.diffusion_model.{k}": v for k, v in _unet_ldm(diffusers_dir).items()}
    te1, _ = _component(diffusers_dir, "text_encoder")
    tensors.update({f"conditioner.embedders.0.transformer.{k}": v for k, v in _hf_clip_keys(te1).items()})
    te2, _ = _component(diffusers_dir, "text_encoder_2")
    tensors.update({f"conditioner.embedders.1.model.{k}": v for k, v in _open_clip(te2).items()})
    if vae:
        tensors.update({f"first_stage_model.{k}": v for k, v in _vae_ldm(diffusers_dir).items()})
    if v_pred:
        tensors["v_pred"] = torch.tensor([])
    return _save(tensors, out_file, metadata)


def write_sdxl_vae(diffusers_dir: Path, out_file: Path) -> Path:
    """The VAE alone, LDM keys without prefix, as sdxl_vae.safetensors."""
    return _save(_vae_ldm(diffusers_dir), out_file)


def write_bfl_chroma(diffusers_dir: Path, out_file: Path) -> Path:
    """A Chroma transformer in BFL's layout (as lodestones publish it), laid out by imglora's key plan
    read backwards: the fused qkv / linear1 weights assembled from their row slices. (What the plan
    says is checked against diffusers' own Chroma converter in test_training_from_files.py.)"""
    from imglora.families.chroma.singlefile import chroma_plan

    sd, config = _component(diffusers_dir, "transformer")
    out: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for key, (src, rows, _op) in chroma_plan(config).items():
        out.setdefault(src, []).append((rows[0] if rows else 0, sd[key]))
    return _save({k: torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]) for k, parts in out.items()},
                 out_file)


def write_flux_ae(diffusers_dir: Path, out_file: Path) -> Path:
    """FLUX's ae.safetensors: the 16-channel VAE in BFL's (= LDM's) names, no quant convs."""
    return _save(_vae_ldm(diffusers_dir), out_file)


def flux_diffusers_to_bfl(config: dict[str, Any]) -> dict[str, tuple[str, int, int] | str]:
    """diffusers key -> BFL key, or (BFL key, first row, rows) for the fused qkv / linear1 weights,
    after ComfyUI's flux_to_diffusers. Without the .weight/.bias suffix."""
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    mlp = 4 * hidden
    out: dict[str, tuple[str, int, int] | str] = {
        "x_embedder": "img_in", "context_embedder": "txt_in",
        "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
        "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
        "proj_out": "final_layer.linear", "norm_out.linear": "final_layer.adaLN_modulation.1",
    }
    if config.get("guidance_embeds"):
        out["time_text_embed.guidance_embedder.linear_1"] = "guidance_in.in_layer"
        out["time_text_embed.guidance_embedder.linear_2"] = "guidance_in.out_layer"
    for i in range(config["num_layers"]):
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        out |= {d + "norm1.linear": b + "img_mod.lin", d + "norm1_context.linear": b + "txt_mod.lin",
                d + "attn.to_out.0": b + "img_attn.proj", d + "attn.to_add_out": b + "txt_attn.proj",
                d + "ff.net.0.proj": b + "img_mlp.0", d + "ff.net.2": b + "img_mlp.2",
                d + "ff_context.net.0.proj": b + "txt_mlp.0", d + "ff_context.net.2": b + "txt_mlp.2",
                d + "attn.norm_q": b + "img_attn.norm.query_norm", d + "attn.norm_k": b + "img_attn.norm.key_norm",
                d + "attn.norm_added_q": b + "txt_attn.norm.query_norm",
                d + "attn.norm_added_k": b + "txt_attn.norm.key_norm"}
        for n, (img, txt) in enumerate((("to_q", "add_q_proj"), ("to_k", "add_k_proj"), ("to_v", "add_v_proj"))):
            out[d + "attn." + img] = (b + "img_attn.qkv", n * hidden, hidden)
            out[d + "attn." + txt] = (b + "txt_attn.qkv", n * hidden, hidden)
    for i in range(config["num_single_layers"]):
        d, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        out |= {d + "proj_out": b + "linear2", d + "norm.linear": b + "modulation.lin",
                d + "attn.norm_q": b + "norm.query_norm", d + "attn.norm_k": b + "norm.key_norm",
                d + "attn.to_q": (b + "linear1", 0, hidden), d + "attn.to_k": (b + "linear1", hidden, hidden),
                d + "attn.to_v": (b + "linear1", 2 * hidden, hidden),
                d + "proj_mlp": (b + "linear1", 3 * hidden, mlp)}
    return out


def write_bfl_flux(diffusers_dir: Path, out_file: Path, *, prefix: str = "", fp8: bool = False,
                   scaled: bool = False) -> Path:
    """The transformer in BFL's layout, as flux1-dev.safetensors (``prefix=""``) or inside a
    ComfyUI checkpoint (``prefix="model.diffusion_model."``).

    ``fp8=True``: every 2-D Linear weight of the double/single blocks stored as float8_e4m3fn, as
    in flux1-dev-fp8 files; biases and norm scales keep their dtype. ``scaled=True`` additionally
    writes ComfyUI's legacy "scaled fp8" form: weight / scale in fp8, ``<layer>.scale_weight``
    (float32 scalar) and a ``scaled_fp8`` marker key.
    """
    sd, config = _component(diffusers_dir, "transformer")
    table = flux_diffusers_to_bfl(config)
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for key, tensor in sd.items():
        stem, suffix = key.rsplit(".", 1)
        target = table[stem]
        if isinstance(target, tuple):
            name, row, _rows = target
            parts.setdefault(f"{name}.{suffix}", []).append((row, tensor))
        else:
            bfl_suffix = "scale" if stem.endswith(("norm_q", "norm_k", "norm_added_q", "norm_added_k")) else suffix
            parts[f"{target}.{bfl_suffix}"] = [(0, tensor)]
    bfl = {k: torch.cat([t for _, t in sorted(v, key=lambda p: p[0])]) for k, v in parts.items()}
    for k in ("final_layer.adaLN_modulation.1.weight", "final_layer.adaLN_modulation.1.bias"):
        scale, shift = bfl[k].chunk(2, dim=0)  # diffusers [scale; shift] -> BFL [shift; scale]
        bfl[k] = torch.cat([shift, scale])
    if fp8 or scaled:
        for k in list(bfl):
            if k.startswith(("double_blocks.", "single_blocks.")) and k.endswith(".weight") and bfl[k].ndim == 2:
                w = bfl[k]
                if scaled:
                    scale = (w.abs().max().float() / FP8_MAX).reshape(())
                    bfl[k] = (w.float() / scale).to(FP8)
                    bfl[k[: -len("weight")] + "scale_weight"] = scale
                else:
                    bfl[k] = w.to(FP8)
        if scaled:
            bfl["scaled_fp8"] = torch.empty(0, dtype=FP8)
    return _save({prefix + k: v for k, v in bfl.items()}, out_file)


def write_clip_l(diffusers_dir: Path, out_file: Path) -> Path:
    """clip_l.safetensors as in comfyanonymous/flux_text_encoders: HF names with ``text_model.``."""
    sd, _ = _component(diffusers_dir, "text_encoder")
    return _save(_hf_clip_keys(sd), out_file)


def write_t5xxl(diffusers_dir: Path, out_file: Path, *, fp8: bool = False,
                dtype: torch.dtype = torch.float16, sub: str = "text_encoder_2") -> Path:
    """t5xxl_fp16.safetensors, or t5xxl_fp8_e4m3fn.safetensors with ``fp8=True`` (every tensor,
    norms and embeddings included, in float8_e4m3fn). HF T5EncoderModel names, the shared
    embedding stored twice (``shared.weight`` and ``encoder.embed_tokens.weight``) as in those files.
    ``dtype``: another storage precision (float32 for comparisons that must be exact)."""
    sd, _ = _component(diffusers_dir, sub)
    sd.setdefault("encoder.embed_tokens.weight", sd["shared.weight"])
    dtype = FP8 if fp8 else dtype
    return _save({k: v.to(dtype, copy=True) for k, v in sd.items()}, out_file)


# --------------------------------------------------------------------------------------------
# ComfyUI folder
# --------------------------------------------------------------------------------------------

COMFY_MODEL_FOLDERS = ("checkpoints", "diffusion_models", "unet", "text_encoders", "clip", "vae", "loras")


def make_comfyui_tree(root: Path, files: dict[str, Path], *, extra_yaml: dict | None = None,
                      tokenizers_from: Path | None = None) -> Path:
    """A ComfyUI-shaped folder: sources markers, models/<folder>/ for the usual folders, ``files``
    copied to their paths relative to ``root`` (e.g. ``"models/unet/flux1-dev.safetensors"``), an
    optional extra_model_paths.yaml, and the tokenizer folders ComfyUI ships, filled from the tiny
    FLUX model's CLIP and T5 tokenizers (``tokenizers_from``, default ``ensure_tiny(registry.get("flux"))``).
    ComfyUI's sd1_tokenizer config says model_max_length 8192; the copy keeps that quirk."""
    import yaml

    from imglora.families import registry
    from imglora.models.tiny import ensure_tiny

    root = Path(root)
    (root / "comfy").mkdir(parents=True, exist_ok=True)
    (root / "main.py").write_text("# ComfyUI stand-in\n")
    (root / "folder_paths.py").write_text("# ComfyUI stand-in\n")
    (root / "comfy" / "__init__.py").write_text("")
    for name in COMFY_MODEL_FOLDERS:
        (root / "models" / name).mkdir(parents=True, exist_ok=True)
    for rel, src in files.items():
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
    if extra_yaml is not None:
        (root / "extra_model_paths.yaml").write_text(yaml.safe_dump(extra_yaml, sort_keys=False))
    tok = Path(tokenizers_from) if tokenizers_from is not None else ensure_tiny(registry.get("flux"))
    clip_dir, t5_dir = root / "comfy" / "sd1_tokenizer", root / "comfy" / "text_encoders" / "t5_tokenizer"
    shutil.copytree(tok / "tokenizer", clip_dir, dirs_exist_ok=True)
    shutil.copytree(tok / "tokenizer_2", t5_dir, dirs_exist_ok=True)
    cfg = json.loads((clip_dir / "tokenizer_config.json").read_text())
    (clip_dir / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_max_length": 8192}, indent=2))
    return root


# --------------------------------------------------------------------------------------------
# Qwen-Image: ComfyUI's split files (Comfy-Org/Qwen-Image_ComfyUI)
# --------------------------------------------------------------------------------------------
# The transformer keeps diffusers' names (comfy/ldm/qwen_image/model.py has them one to one), bare
# or under model.diffusion_model.; Qwen2.5-VL keeps Hugging Face's original names (model.layers.*,
# visual.*), its Linear weights in ComfyUI's legacy scaled fp8 (<layer>.weight in float8_e4m3fn with a
# float32 <layer>.scale_weight, and a root scaled_fp8 marker); the VAE is Wan 2.1's original layout
# (comfy/ldm/wan/vae.py WanVAE: flat encoder.downsamples / decoder.upsamples of residual blocks
# (residual.0 norm, .2 conv, .3 norm, .6 conv, shortcut) and resamples, middle.0/1/2, head.0/2,
# conv1/conv2 around the latent), written here from that module tree, diffusers -> original.


def write_qwen_image_transformer(diffusers_dir: Path, out_file: Path, *, prefix: str = UNET_PREFIX,
                                 fp8: bool = False) -> Path:
    """qwen_image_bf16.safetensors (here: the tiny model's float32) or, with ``fp8``,
    qwen_image_fp8_e4m3fn.safetensors (every tensor cast to float8_e4m3fn, no scales)."""
    sd, _ = _component(diffusers_dir, "transformer")
    return _save({prefix + k: v.to(FP8) if fp8 else v for k, v in sd.items()}, out_file)


def write_qwen25_vl(diffusers_dir: Path, out_file: Path, *, scaled_fp8: bool = False) -> Path:
    """qwen_2.5_vl_7b.safetensors (original names, float32) or, with ``scaled_fp8``,
    qwen_2.5_vl_7b_fp8_scaled.safetensors: each Linear weight (2-D, in the layers and the vision
    blocks) stored as weight / scale in float8_e4m3fn, scale = absmax / 448."""
    sd, _ = _component(diffusers_dir, "text_encoder")
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        linear = k.endswith(".weight") and v.dim() == 2 and (".layers." in k or ".blocks." in k)
        if scaled_fp8 and linear:
            scale = (v.abs().max() / FP8_MAX).clamp(min=1e-12).float()
            out[k] = (v / scale).to(FP8)
            out[k[: -len("weight")] + "scale_weight"] = scale.reshape(())
        else:
            out[k] = v
    if scaled_fp8:
        out["scaled_fp8"] = torch.empty(0, dtype=FP8)
    return _save(out, out_file)


_WAN_RESNET = {"norm1.gamma": "residual.0.gamma", "conv1": "residual.2", "norm2.gamma": "residual.3.gamma",
               "conv2": "residual.6", "conv_shortcut": "shortcut"}


def _wan_resnet(rest: str) -> str:
    for ours, theirs in _WAN_RESNET.items():
        if rest.startswith(ours):
            return theirs + rest[len(ours):]
    return rest  # resample.1.*, time_conv.*


def qwen_vae_to_wan(key: str, num_res_blocks: int) -> str:
    """A diffusers AutoencoderKLQwenImage key -> the Wan 2.1 original key."""
    import re

    fixed = {"quant_conv": "conv1", "post_quant_conv": "conv2", "encoder.conv_in": "encoder.conv1",
             "decoder.conv_in": "decoder.conv1", "encoder.norm_out.gamma": "encoder.head.0.gamma",
             "decoder.norm_out.gamma": "decoder.head.0.gamma", "encoder.conv_out": "encoder.head.2",
             "decoder.conv_out": "decoder.head.2"}
    for ours, theirs in fixed.items():
        if key == ours or key.startswith(ours + "."):
            return theirs + key[len(ours):]
    m = re.match(r"(encoder|decoder)\.mid_block\.(resnets|attentions)\.(\d)\.(.*)", key)
    if m:
        side, kind, i, rest = m.groups()
        index = 1 if kind == "attentions" else 2 * int(i)
        return f"{side}.middle.{index}.{rest if kind == 'attentions' else _wan_resnet(rest)}"
    m = re.match(r"encoder\.down_blocks\.(\d+)\.(.*)", key)
    if m:
        return f"encoder.downsamples.{m.group(1)}.{_wan_resnet(m.group(2))}"
    m = re.match(r"decoder\.up_blocks\.(\d+)\.(resnets\.(\d+)|upsamplers\.0)\.(.*)", key)
    if m:
        block, _, resnet, rest = m.groups()
        per_block = num_res_blocks + 2  # num_res_blocks + 1 residual blocks, then the upsampler
        index = int(block) * per_block + (int(resnet) if resnet is not None else num_res_blocks + 1)
        return f"decoder.upsamples.{index}.{_wan_resnet(rest)}"
    raise KeyError(f"no Wan 2.1 name for the VAE key {key}")


def write_qwen_image_vae(diffusers_dir: Path, out_file: Path) -> Path:
    """qwen_image_vae.safetensors: the VAE in Wan 2.1's original layout."""
    sd, config = _component(diffusers_dir, "vae")
    return _save({qwen_vae_to_wan(k, config["num_res_blocks"]): v for k, v in sd.items()}, out_file)


# Z-Image's original layout (Tongyi-MAI's, as Comfy-Org's z_image_turbo_bf16.safetensors has it;
# diffusers' convert_z_image_transformer_checkpoint_to_diffusers reads it): q, k and v fused into
# attention.qkv, attention.out, q_norm/k_norm, x_embedder and final_layer for the 2x2 patch entries.
_Z_IMAGE_TO_ORIGINAL = (("all_final_layer.2-1.", "final_layer."), ("all_x_embedder.2-1.", "x_embedder."),
                        (".attention.to_out.0.", ".attention.out."), (".attention.norm_k.", ".attention.k_norm."),
                        (".attention.norm_q.", ".attention.q_norm."))


def write_z_image_transformer(diffusers_dir: Path, out_file: Path, *, prefix: str = "", fp8: bool = False) -> Path:
    """z_image_turbo_bf16.safetensors (here: the tiny model's float32; ``fp8``: every tensor float8_e4m3fn)."""
    sd, _ = _component(diffusers_dir, "transformer")
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if ".attention.to_k." in k or ".attention.to_v." in k:
            continue
        name = k
        for new, old in _Z_IMAGE_TO_ORIGINAL:
            name = name.replace(new, old)
        if ".attention.to_q." in k:
            name = name.replace(".attention.to_q.", ".attention.qkv.")
            v = torch.cat([sd[k], sd[k.replace(".to_q.", ".to_k.")], sd[k.replace(".to_q.", ".to_v.")]])
        out[prefix + name] = v.to(FP8) if fp8 else v
    return _save(out, out_file)


def write_qwen3(diffusers_dir: Path, out_file: Path) -> Path:
    """qwen_3_4b.safetensors: Hugging Face's Qwen3ForCausalLM names (``model.*``; the tiny folder saves
    the bare Qwen3Model) and its tied LM head."""
    sd, _ = _component(diffusers_dir, "text_encoder")
    out = {f"model.{k}": v for k, v in sd.items()}
    out["lm_head.weight"] = sd["embed_tokens.weight"].clone()
    return _save(out, out_file)

"""What is this weights file? Answered from the safetensors header alone (keys, dtypes, shapes).

Users hand over whatever they have downloaded: an SGM checkpoint, a BFL transformer (bf16 or fp8,
bare or inside a ComfyUI checkpoint), a text encoder, a VAE, or by mistake a LoRA. Classifying
first lets every loader fail at once with a message that names the file and says what it is,
instead of deep inside a key conversion. Nothing but the header is read, so this takes
milliseconds even for a 24 GB file.

Detection keys are the ones ComfyUI (``comfy/model_detection.py``, ``comfy/sd.py::detect_te_model``)
and diffusers (``single_file_utils.CHECKPOINT_KEY_NAMES``) use.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ....errors import ModelSourceError
from ....models.safefiles import PathLike, Reader, is_side_key, open_file

KINDS = ("sdxl-checkpoint", "flux-transformer", "chroma-transformer", "qwen-image-transformer", "z-image-transformer",
         "flux2-transformer", "krea2-transformer", "qwen-image-2.1-transformer", "clip-l", "t5xxl", "qwen25-vl-7b", "qwen3-4b", "qwen3-8b",
         "qwen3vl-4b", "qwen3vl-8b", "mistral3-small", "vae-sdxl", "vae-flux", "vae-flux2", "vae-qwen-image", "vae-qwen-image-2.1", "lora", "unknown")

UNET_PREFIX = "model.diffusion_model."
CLIP_L_KEY = "text_model.encoder.layers.0.mlp.fc1.weight"
SGM_CLIP_L = "conditioner.embedders.0.transformer."
SGM_CLIP_G = "conditioner.embedders.1.model."
SGM_VAE = "first_stage_model."
FLUX_KEY = "double_blocks.0.img_attn.norm.key_norm.scale"
T5_KEY = "encoder.block.0.layer.1.DenseReluDense.wi_1.weight"
QWEN_IMAGE_KEY = "txt_norm.weight"  # ComfyUI's test for Qwen-Image (model_detection.py)
# diffusers' test for Qwen-Image 2.1 (CHECKPOINT_KEY_NAMES["qwen-image-2.1"]): its text embedder's norm
QWEN_IMAGE21_KEY = "txt_in.text_norm.weight"
QWEN25_KEY = "model.layers.0.self_attn.k_proj.bias"  # ComfyUI's test for Qwen2.5 (sd.py::detect_te_model)
Z_IMAGE_KEY = "layers.0.adaLN_modulation.0.weight"  # diffusers' test for Z-Image (Lumina 2's is ...modulation.1)
QWEN3_KEY = "model.layers.0.self_attn.q_norm.weight"  # Qwen3's attention has q/k norms (Qwen2.5's has biases)
WAN21_VAE_KEY = "decoder.middle.0.residual.0.gamma"  # ComfyUI's test for Wan's VAE (sd.py)
WAN22_VAE_KEY = "decoder.upsamples.0.upsamples.0.residual.2.weight"  # ComfyUI's test for Wan 2.2's nested layout
FLUX2_KEY = "double_stream_modulation_img.lin.weight"  # FLUX.2's shared modulation (FLUX.1 has one per block)
# FLUX.2's sizes by txt_in's input width (three of the text encoder's layers side by side)
FLUX2_VARIANTS = {7680: "klein-4b", 12288: "klein-9b", 15360: "dev"}
KREA2_KEY = "txtfusion.projector.weight"  # diffusers' test for Krea 2 (CHECKPOINT_KEY_NAMES["krea2"])
# Qwen3-VL in transformers' layout (model.language_model.*, model.visual.*) as ComfyUI's files have it, or with
# the language model at model.* and the vision tower at visual.*; ComfyUI tests the deepstack merger
QWEN3VL_LAYOUTS = (("model.language_model.", "model.visual."), ("model.", "visual."))
QWEN3_SIZES = {2560: "4b", 4096: "8b"}  # the hidden width of Qwen3-4B / -8B (and Qwen3-VL-4B / -8B)
# A Llama-layout text encoder in Hugging Face's names (model.layers.N.post_attention_layernorm, no q/k norms, no
# k_proj bias, no Gemma feed-forward norms): ComfyUI's sd.py::detect_te_model takes width 5120 for Mistral-Small-3
# (MISTRAL3_24B with model.layers.39.*, else MISTRAL3_24B_PRUNED_FLUX2: the 30 layers FLUX.2 [dev] reads)
MISTRAL_KEY = "model.layers.0.post_attention_layernorm.weight"
MISTRAL3_SMALL_WIDTH = 5120
LORA_MARKERS = (".lora_up.", ".lora_down.", ".lora_A.", ".lora_B.", ".lora.up.", ".lora.down.", ".hada_w1_a",
                ".lokr_w1")


@dataclass(frozen=True)
class Layout:
    """What a file holds. ``prefix`` is the key prefix of the main part (the UNet, the FLUX
    transformer, the text encoder or the VAE); ``parts`` the components found in a checkpoint."""

    path: Path
    kind: str
    prefix: str = ""
    parts: tuple[str, ...] = ()
    variant: str | None = None  # FLUX.1: "dev" (has guidance_in) or "schnell"; FLUX.2: FLUX2_VARIANTS' names
    fp8: bool = False  # weights stored as float8
    scaled: bool = False  # fp8 with per-tensor scale keys (scale_weight / weight_scale)
    tensors: int = 0
    dtypes: tuple[str, ...] = ()
    first_keys: tuple[str, ...] = ()
    note: str = ""

    def __str__(self) -> str:
        bits = [b for b in (self.variant, "fp8" if self.fp8 else "", "scaled" if self.scaled else "",
                            f"prefix {self.prefix!r}" if self.prefix else "",
                            f"parts {'+'.join(self.parts)}" if self.parts else "",
                            f"{self.tensors} tensors", "/".join(self.dtypes)) if b]
        text = f"{self.kind} ({', '.join(bits)})"
        if self.note:
            text += f": {self.note}"
        if self.kind == "unknown" and self.first_keys:
            text += f"; first keys: {', '.join(self.first_keys)}"
        return text


def describe(path: PathLike) -> Layout:
    """Classify ``path`` from its header. Raises ModelSourceError for pickles (.ckpt/.pt/.pth/.bin),
    missing files and files that are not valid safetensors (e.g. truncated)."""
    with open_file(path) as reader:
        return classify(reader)


def classify(r: Reader) -> Layout:
    keys = r.key_set
    dtypes = tuple(sorted({r.dtype_name(k) for k in r.keys}))
    base = {"path": r.path, "tensors": len(r.keys), "dtypes": dtypes, "first_keys": tuple(sorted(keys)[:5])}

    def fp8(names: list[str]) -> bool:
        return any(r.dtype_name(k).startswith("F8") for k in names)

    scaled = any(is_side_key(k) and not k.endswith(".comfy_quant") for k in keys)

    if any(m in k for k in keys for m in LORA_MARKERS):
        return Layout(kind="lora", note="adapter weights (LoRA/LoHa/LoKr), not a base model", **base)

    # SDXL: an LDM UNet with SDXL's label embedding (SD1.x/2.x have none), in an SGM checkpoint
    # or alone (e.g. saved into ComfyUI's models/diffusion_models).
    for prefix in (UNET_PREFIX, ""):
        if f"{prefix}input_blocks.0.0.weight" in keys:
            if f"{prefix}label_emb.0.0.weight" not in keys:
                return Layout(kind="unknown", prefix=prefix, note="an SD1.x/SD2.x checkpoint (LDM UNet without "
                              "SDXL's label_emb); imglora trains SDXL and FLUX.1", **base)
            parts = ["unet"]
            note = ""
            if SGM_CLIP_L + CLIP_L_KEY in keys:
                parts.append("clip_l")
            if SGM_CLIP_G + "transformer.resblocks.0.attn.in_proj_weight" in keys:
                parts.append("clip_g")
            elif "conditioner.embedders.0.model.transformer.resblocks.0.attn.in_proj_weight" in keys:
                note = "the SDXL refiner (its only text encoder, OpenCLIP bigG, sits at embedders.0)"
            if SGM_VAE + "encoder.conv_in.weight" in keys:
                parts.append("vae")
            return Layout(kind="sdxl-checkpoint", prefix=prefix, parts=tuple(parts), note=note,
                          fp8=fp8(r.with_prefix(prefix + "input_blocks.")), scaled=scaled, **base)

    for prefix in ("", UNET_PREFIX):
        if prefix + FLUX2_KEY in keys:
            width = r.shape(prefix + "txt_in.weight")[1] if prefix + "txt_in.weight" in keys else 0
            variant = FLUX2_VARIANTS.get(width)
            note = "" if variant else (f"txt_in takes {width} features: not a released size ([klein] 4B 7680, 9B "
                                       "12288, [dev] 15360); give its diffusers folder as model.config")
            blocks = r.with_prefix(prefix + "double_blocks.") + r.with_prefix(prefix + "single_blocks.")
            return Layout(kind="flux2-transformer", prefix=prefix, parts=("transformer",), variant=variant,
                          fp8=fp8(blocks), scaled=scaled, note=note, **base)
        if prefix + KREA2_KEY in keys:
            return Layout(kind="krea2-transformer", prefix=prefix, parts=("transformer",),
                          fp8=fp8(r.with_prefix(prefix + "blocks.")), scaled=scaled, **base)
        if any(k.startswith(prefix + "distilled_guidance_layer.") for k in keys):
            if any(k.startswith(prefix + "nerf_") for k in keys):
                return Layout(kind="unknown", prefix=prefix, note="a Chroma Radiance transformer (pixel space); "
                              "imglora trains Chroma's latent models", **base)
            blocks = r.with_prefix(prefix + "double_blocks.") + r.with_prefix(prefix + "single_blocks.")
            return Layout(kind="chroma-transformer", prefix=prefix, parts=("transformer",), fp8=fp8(blocks),
                          scaled=scaled, **base)
        if prefix + FLUX_KEY in keys:
            parts = ["transformer"]
            parts += [name for name, key in (
                ("vae", "vae.encoder.conv_in.weight"),
                ("clip_l", "text_encoders.clip_l.transformer." + CLIP_L_KEY),
                ("t5xxl", "text_encoders.t5xxl.transformer." + T5_KEY)) if key in keys]
            variant = "dev" if prefix + "guidance_in.in_layer.weight" in keys else "schnell"
            note = ""
            in_ch = r.shape(prefix + "img_in.weight")[1]
            if in_ch in (128, 384):  # diffusers' and ComfyUI's test for the Depth/Canny and Fill models
                note = f"img_in takes {in_ch} channels: FLUX.1 {'Fill' if in_ch == 384 else 'Depth/Canny'}"
            blocks = r.with_prefix(prefix + "double_blocks.") + r.with_prefix(prefix + "single_blocks.")
            return Layout(kind="flux-transformer", prefix=prefix, parts=tuple(parts), variant=variant,
                          fp8=fp8(blocks), scaled=scaled, note=note, **base)

    for prefix in ("", UNET_PREFIX):
        # Qwen-Image 2.1 first: diffusers' module names (its MLP's gate and up fused by ComfyUI), and no
        # txt_norm, but tested before Qwen-Image so that a file with both never reads as Qwen-Image.
        if prefix + QWEN_IMAGE21_KEY in keys:
            return Layout(kind="qwen-image-2.1-transformer", prefix=prefix, parts=("transformer",),
                          fp8=fp8(r.with_prefix(prefix + "transformer_blocks.")), scaled=scaled,
                          note="Qwen-Image 2.1's, not Qwen-Image's", **base)
        if prefix + QWEN_IMAGE_KEY in keys and prefix + "transformer_blocks.0.img_mod.1.weight" in keys:
            return Layout(kind="qwen-image-transformer", prefix=prefix, parts=("transformer",),
                          fp8=fp8(r.with_prefix(prefix + "transformer_blocks.")), scaled=scaled, **base)

    for prefix in ("", UNET_PREFIX):
        if prefix + Z_IMAGE_KEY in keys and prefix + "cap_embedder.1.weight" in keys:
            blocks = r.with_prefix(prefix + "layers.") + r.with_prefix(prefix + "noise_refiner.")
            return Layout(kind="z-image-transformer", prefix=prefix, parts=("transformer",), fp8=fp8(blocks),
                          scaled=scaled, **base)

    for language, vision in QWEN3VL_LAYOUTS:
        if vision + "deepstack_merger_list.0.norm.weight" in keys or (
                language == "model.language_model." and language + "embed_tokens.weight" in keys):
            if language + "embed_tokens.weight" not in keys:
                return Layout(kind="unknown", note="a Qwen3-VL vision tower without its language model", **base)
            width = r.shape(language + "embed_tokens.weight")[1]
            size = QWEN3_SIZES.get(width)
            if size is None:
                return Layout(kind="unknown", prefix=language, note=f"a Qwen3-VL of width {width} (Krea 2 reads "
                              "Qwen3-VL-4B, width 2560; Qwen-Image 2.1 Qwen3-VL-8B, width 4096)", **base)
            return Layout(kind=f"qwen3vl-{size}", prefix=language, fp8=fp8(r.keys), scaled=scaled, **base)

    if QWEN3_KEY in keys and "model.embed_tokens.weight" in keys:
        width = r.shape("model.embed_tokens.weight")[1]
        size = QWEN3_SIZES.get(width)  # ComfyUI's size test (sd.py::detect_te_model)
        if size is None:
            return Layout(kind="unknown", note=f"a Qwen3 text encoder of width {width} (Z-Image and FLUX.2 [klein] "
                          "4B read Qwen3-4B, width 2560; [klein] 9B Qwen3-8B, width 4096)", **base)
        return Layout(kind=f"qwen3-{size}", fp8=fp8(r.keys), scaled=scaled, **base)

    if QWEN25_KEY in keys:
        if r.shape(QWEN25_KEY)[0] == 256:  # ComfyUI's size test: 2 key/value heads of 128 (the 7B has 4)
            return Layout(kind="unknown", note="Qwen2.5-VL-3B (Qwen-Image reads Qwen2.5-VL-7B)", **base)
        note = "" if "visual.patch_embed.proj.weight" in keys else "no vision tower (visual.*): a text-only Qwen2.5-7B?"
        if note:
            return Layout(kind="unknown", note=note, **base)
        return Layout(kind="qwen25-vl-7b", fp8=fp8(r.keys), scaled=scaled, **base)

    if MISTRAL_KEY in keys and "model.layers.0.post_feedforward_layernorm.weight" not in keys:
        width = r.shape(MISTRAL_KEY)[0]
        if width != MISTRAL3_SMALL_WIDTH:
            return Layout(kind="unknown", note=f"a Llama-layout text encoder of width {width} (FLUX.2 [dev] reads "
                          f"Mistral-Small-3, width {MISTRAL3_SMALL_WIDTH})", **base)
        layers = sum(1 for k in keys if k.startswith("model.layers.") and k.endswith(".post_attention_layernorm.weight"))
        pruned = "model.layers.39.post_attention_layernorm.weight" not in keys
        note = (f"{layers} layers: ComfyUI's FLUX.2 cut (layers 30 to 39 removed)" if pruned else f"{layers} layers")
        return Layout(kind="mistral3-small", prefix="model.", variant="pruned" if pruned else "full",
                      fp8=fp8(r.with_prefix("model.layers.")), scaled=scaled, note=note, **base)

    if WAN21_VAE_KEY in keys:
        if WAN22_VAE_KEY in keys:
            # Wan 2.2's nested layout: Wan 2.2's own VAE (48 latent channels, 2x2 patches: 12 pixel channels) or
            # Qwen-Image 2.1's (64 latent channels, RGBA: 4), told apart by the shapes of conv2 and the decoder's head
            latent = r.shape("conv2.weight")[0] if "conv2.weight" in keys else 0
            pixels = r.shape("decoder.head.2.weight")[0] if "decoder.head.2.weight" in keys else 0
            if (latent, pixels) == (64, 4):
                return Layout(kind="vae-qwen-image-2.1", note="Wan 2.2's nested layout, which Qwen-Image 2.1's "
                              "RGBA VAE has", **base)
            return Layout(kind="unknown", note=f"a VAE in Wan 2.2's layout with {latent} latent and {pixels} pixel "
                          "channels (Wan 2.2's has 48 and 12; Qwen-Image uses Wan 2.1's VAE, Qwen-Image 2.1 its own "
                          "of 64 and 4)", **base)
        return Layout(kind="vae-qwen-image", note="Wan 2.1's VAE layout, which Qwen-Image's VAE has", **base)

    for prefix in ("", "text_encoders.clip_l.transformer."):
        for flat in (CLIP_L_KEY, CLIP_L_KEY.removeprefix("text_model.")):  # transformers 5 saves the latter
            if prefix + flat in keys:
                layers = prefix + flat.replace("layers.0.", "layers.{}.")
                if layers.format(30) in keys or layers.format(22) in keys:
                    size = "G" if layers.format(30) in keys else "H"
                    return Layout(kind="unknown", prefix=prefix, note=f"a CLIP-{size} text encoder, not CLIP-L",
                                  **base)
                return Layout(kind="clip-l", prefix=prefix, fp8=fp8(r.keys), **base)

    for prefix in ("", "text_encoders.t5xxl.transformer."):
        if prefix + T5_KEY in keys:
            return Layout(kind="t5xxl", prefix=prefix, fp8=fp8(r.keys), scaled=scaled, **base)
        if prefix + "encoder.block.0.layer.1.DenseReluDense.wi.weight" in keys:
            return Layout(kind="unknown", prefix=prefix, note="an original T5 (not v1.1 / T5-XXL as FLUX uses)",
                          **base)

    for prefix in ("", SGM_VAE, "vae."):
        if prefix + "encoder.conv_in.weight" in keys and prefix + "decoder.conv_in.weight" in keys:
            if prefix + "encoder.down.0.block.0.conv1.weight" not in keys:
                break  # diffusers' own VAE layout: reported below
            latent = r.shape(prefix + "decoder.conv_in.weight")[1]
            kind = {4: "vae-sdxl", 16: "vae-flux"}.get(latent, "unknown")
            if latent == 32 and prefix + "bn.running_mean" in keys:
                kind = "vae-flux2"  # FLUX.2's: 32 channels, and the batch-norm statistics of its 2x2 patches
            note = "" if kind != "unknown" else (f"a VAE with {latent} latent channels (neither SDXL's 4, FLUX.1's "
                                                 "16 nor FLUX.2's 32 with its bn statistics)")
            return Layout(kind=kind, prefix=prefix, note=note, **base)

    note = ""
    if any(".transformer_blocks.0.attn.to_q." in k or k.startswith(("down_blocks.", "transformer_blocks."))
           or ".down_blocks.0.resnets.0." in k for k in keys):
        note = "a component in diffusers' own layout; give the diffusers model folder instead of this file"
    return Layout(kind="unknown", note=note, **base)


_WANTED = {
    "sdxl-checkpoint": "an SDXL checkpoint (e.g. sd_xl_base_1.0.safetensors)",
    "flux-transformer": "a FLUX.1 transformer (e.g. flux1-dev.safetensors)",
    "chroma-transformer": "a Chroma transformer (e.g. Chroma1-HD.safetensors)",
    "clip-l": "a CLIP-L text encoder (e.g. clip_l.safetensors)",
    "t5xxl": "a T5-XXL text encoder (e.g. t5xxl_fp16.safetensors)",
    "vae-sdxl": "an SDXL VAE (e.g. sdxl_vae.safetensors)",
    "vae-flux": "a FLUX VAE (ae.safetensors)",
    "qwen-image-transformer": "a Qwen-Image transformer (e.g. qwen_image_bf16.safetensors)",
    "qwen25-vl-7b": "Qwen2.5-VL-7B, Qwen-Image's text encoder (e.g. qwen_2.5_vl_7b_fp8_scaled.safetensors)",
    "vae-qwen-image": "Qwen-Image's VAE (qwen_image_vae.safetensors)",
    "z-image-transformer": "a Z-Image transformer (e.g. z_image_turbo_bf16.safetensors)",
    "qwen3-4b": "Qwen3-4B, Z-Image's and FLUX.2 [klein] 4B's text encoder (e.g. qwen_3_4b.safetensors)",
    "qwen3-8b": "Qwen3-8B, FLUX.2 [klein] 9B's text encoder (e.g. qwen_3_8b_fp8mixed.safetensors)",
    "flux2-transformer": "a FLUX.2 transformer (e.g. flux-2-klein-base-4b.safetensors)",
    "vae-flux2": "FLUX.2's VAE (flux2-vae.safetensors)",
    "krea2-transformer": "a Krea 2 transformer (e.g. krea2_raw_bf16.safetensors)",
    "mistral3-small": "Mistral-Small-3 (24B), FLUX.2 [dev]'s text encoder (e.g. mistral_3_small_flux2_bf16.safetensors)",
    "qwen3vl-4b": "Qwen3-VL-4B, Krea 2's text encoder (e.g. qwen3vl_4b_bf16.safetensors)",
    "qwen3vl-8b": "Qwen3-VL-8B, Qwen-Image 2.1's text encoder (e.g. qwen3vl_8b_bf16.safetensors)",
    "qwen-image-2.1-transformer": "a Qwen-Image 2.1 transformer (e.g. qwen_image_2.1_bf16.safetensors)",
    "vae-qwen-image-2.1": "Qwen-Image 2.1's VAE (qwen_image_2.1_vae_bf16.safetensors)",
}


FAMILY_OF = {"sdxl-checkpoint": "sdxl", "flux-transformer": "flux", "chroma-transformer": "chroma",
             "qwen-image-transformer": "qwen_image", "z-image-transformer": "z_image", "flux2-transformer": "flux2",
             "krea2-transformer": "krea2", "qwen-image-2.1-transformer": "qwen_image21"}  # a base model file -> the family that trains it


def expect(path: PathLike, *kinds: str, also: tuple[str, ...] = ()) -> Layout:
    """``describe(path)``, raising a message that names the file unless its kind is one of
    ``kinds`` (or of ``also``: accepted, e.g. checkpoints holding the part, but not suggested)."""
    layout = describe(path)
    if layout.kind in kinds or layout.kind in also:
        return layout
    wanted = " or ".join(_WANTED.get(k, k) for k in kinds)
    if layout.kind == "lora":
        raise ModelSourceError(f"{layout.path} is a LoRA (adapter weights such as {layout.first_keys[0]}), not a "
                               f"base model; give {wanted} here. A LoRA is applied on top of its base model.")
    family = FAMILY_OF.get(layout.kind)
    hint = f"; to train it, set model.family = \"{family}\"" if family and family not in (FAMILY_OF.get(k) for k in kinds) else ""
    raise ModelSourceError(f"{layout.path} is not {wanted}; it looks like {layout}{hint}")

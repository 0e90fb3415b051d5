"""FLUX.1: flow-matching transformer LoRA on cached VAE latents and cached CLIP-L + T5 outputs.

Everything about the family is in this folder: loading and the loss (``model``), its preset section
(``config``), its swappable blocks and kohya's swap count (``swap``), its export key forms
(``keys``), its ComfyUI workflow (``comfyui``), its tiny model (``tiny``). It implements every
protocol of ``imglora.family`` except ``Mergeable``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...adapters import KINDS
from ...util.owned import own_module
from .._shared import diffusers_image as common
from . import comfyui, keys, model, singlefile, swap, tiny
from .config import FluxConfig

if TYPE_CHECKING:
    from ...memory.swap import SwapLayout
    from ...models.source import ModelSource


class FluxFamily:
    name = "flux"
    section = FluxConfig
    model_marker = "model_index.json"
    # imglora fetch: the bare single-file names this family's ComfyUI presets use, and where each is
    # published (repository, path in it, ComfyUI folder kind), as ComfyUI's examples download them
    published_files = {
        "flux1-dev.safetensors": ("black-forest-labs/FLUX.1-dev", "flux1-dev.safetensors", "diffusion_models"),
        "ae.safetensors": ("black-forest-labs/FLUX.1-dev", "ae.safetensors", "vae"),
        "clip_l.safetensors": ("comfyanonymous/flux_text_encoders", "clip_l.safetensors", "text_encoders"),
        "t5xxl_fp16.safetensors": ("comfyanonymous/flux_text_encoders", "t5xxl_fp16.safetensors", "text_encoders"),
        "t5xxl_fp8_e4m3fn_scaled.safetensors": ("comfyanonymous/flux_text_encoders",
                                                "t5xxl_fp8_e4m3fn_scaled.safetensors", "text_encoders"),
    }
    adapter_file = common.ADAPTER_FILE
    adapter_format = "a diffusers LoRA: pipe.load_lora_weights(folder)"
    bucket_step = 16
    text_max_length = model.TEXT_MAX_LENGTH
    lora_targets = (
        # double blocks: image and text streams
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
        # single blocks
        "proj_mlp", "proj_out",
    )
    # Only inside the blocks: the final projection is also called proj_out.
    lora_scope = r"(transformer_blocks|single_transformer_blocks)\.\d+\."
    lora_blocks = {"double": "transformer_blocks", "single": "single_transformer_blocks"}  # lora.blocks' kinds
    quantize_exclude = ("x_embedder", "context_embedder", "time_text_embed*", "norm_out*", "proj_out")
    quantizations: tuple[str, ...] = ()
    adapter_types = tuple(KINDS)  # all on fp8 bases too (DoRA norms the dequantized weight)
    swappable_blocks = swap.BLOCK_LISTS
    compile_blocks = ("FluxTransformerBlock", "FluxSingleTransformerBlock")  # memory.compile = "blocks"
    streams_blocks = True  # the transformer is read block by block (_shared.stream): plan's host-RAM term
    export_formats = keys.FORMATS
    # lora.text_encoder: CLIP-L gets the adapter (its pooled output is then computed per step); T5 stays
    # frozen and its cached output is used as before.
    text_encoder_parts = ("text_encoder",)
    text_encoder_targets = common.CLIP_TARGETS
    text_encoder_scope = common.CLIP_SCOPE
    frozen_text_outputs = ("prompt_embeds",)
    pipeline = "FluxPipeline"  # diffusers pipeline class (adapter save/load layout, sampling)
    trainable = model.FluxTrainable  # the loss (a model on this transformer may condition it further)
    denoiser = "transformer"  # its subfolder and the adapter keys' prefix

    # Shared with the other diffusers image family (see diffusers_image).
    vae_folders = common.vae_folders
    text_folders = common.text_folders
    prepare_data = common.prepare_data
    data_version = common.data_version
    collate = common.collate
    save_adapter = common.save_adapter
    read_adapter = common.read_adapter
    base_weights = common.base_weights
    default_prompts = common.default_prompts
    encode_prompts = common.encode_prompts

    def check_config(self, cfg: Any, where: Callable[[str], str], problems: list[str]) -> None:
        common.check_config(self, cfg, where, problems)
        f = cfg.family
        if cfg.memory.blocks_to_swap and (f.double_blocks_to_swap >= 0 or f.single_blocks_to_swap >= 0):
            problems.append(f"{where('memory.blocks_to_swap')}: give either memory.blocks_to_swap or "
                            f"{self.name}.double_blocks_to_swap/single_blocks_to_swap, not both")
        form = self.export_formats[0] if cfg.export.format == "default" else cfg.export.format
        if cfg.lora.type not in keys.FORM_TYPES.get(form, (cfg.lora.type,)):  # an unknown form: the common check
            problems.append(f"{where('export.format')}: {keys.KOHYA_FUSES}, and lora.type = {cfg.lora.type!r}; use "
                            f"export.format = \"default\" (ComfyUI loads {cfg.lora.type} in it, patching each slice) "
                            "or lora.type = \"lora\"")

    def build_tiny(self, dest: Path, seed: int) -> None:
        tiny.build(dest, seed)

    def resolve_files(self, model_cfg: Any, find: Any) -> "ModelSource":
        return singlefile.resolve_files(model_cfg, find)

    # -- cache ------------------------------------------------------------------------------
    def load_vae(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
        if src.files:
            return singlefile.load_vae(src, dtype).to(device).eval()
        return common.load_vae(self, src, device, dtype)

    @torch.no_grad()
    def encode_image(self, vae: Any, pixels: torch.Tensor, std: bool = False) -> dict[str, torch.Tensor]:
        dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
        c = vae.config
        return common.scaled_posterior(dist, std, lambda x: (x - c.shift_factor) * c.scaling_factor, c.scaling_factor)

    def load_text_encoders(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
        from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

        tokenizers = (CLIPTokenizer.from_pretrained(src.root, subfolder="tokenizer"),
                      T5TokenizerFast.from_pretrained(src.root, subfolder="tokenizer_2"))
        if src.files:
            encoders = singlefile.load_text_encoders(src, dtype)
        else:
            encoders = (CLIPTextModel.from_pretrained(src.root, subfolder="text_encoder", torch_dtype=dtype),
                        T5EncoderModel.from_pretrained(src.root, subfolder="text_encoder_2", torch_dtype=dtype))
        return (*tokenizers, *(own_module(e).to(device).eval() for e in encoders))

    def text_options(self, cfg: Any) -> dict[str, Any]:
        """[flux] apply_t5_attn_mask changes T5's output: keyed in the text cache (only when on, so
        the entries made without it keep their keys)."""
        return {"t5_attention_mask": True} if getattr(cfg.family, "apply_t5_attn_mask", False) else {}

    def default_text_length(self, src: "ModelSource") -> int:
        """T5 tokens: 512 for FLUX.1-dev (FluxPipeline's), 256 for FLUX.1-schnell (its pipeline's
        limit, and kohya's default), read from the transformer's config (schnell has no guidance
        embedding)."""
        import json

        config = json.loads((src.root / "transformer" / "config.json").read_text())
        return model.TEXT_MAX_LENGTH if config.get("guidance_embeds", False) else model.SCHNELL_TEXT_MAX_LENGTH

    @torch.no_grad()
    def encode_text(self, encoders: Any, caption: str, max_length: int,
                    t5_attention_mask: bool = False) -> dict[str, torch.Tensor]:
        # As FluxPipeline.encode_prompt: CLIP-L pooled output (77 tokens) and T5 last hidden state.
        # With T5's attention mask (kohya's apply_t5_attn_mask), T5 reads the tokenizer's mask and the
        # mask is cached with its output, for the transformer's attention.
        clip_tok, t5_tok, clip, t5 = encoders
        ids = clip_tok(caption, padding="max_length", max_length=clip_tok.model_max_length, truncation=True,
                       return_tensors="pt").input_ids.to(clip.device)
        pooled = clip(ids, output_hidden_states=False).pooler_output
        t = t5_tok(caption, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
        mask = t.attention_mask.to(t5.device) if t5_attention_mask else None
        t5_out = t5(t.input_ids.to(t5.device), attention_mask=mask, output_hidden_states=False)[0]
        out = {"prompt_embeds": t5_out[0].cpu(), "pooled_prompt_embeds": pooled[0].cpu()}
        if t5_attention_mask:
            out["text_mask"] = t.attention_mask[0].bool()
        return out

    def load_tokenizers(self, src: "ModelSource") -> Any:
        from transformers import CLIPTokenizer

        return CLIPTokenizer.from_pretrained(src.root, subfolder="tokenizer")

    def tokenize(self, tokenizer: Any, caption: str, max_length: int) -> dict[str, torch.Tensor]:
        """CLIP-L's tokens, as encode_text makes them (lora.text_encoder; T5's output stays cached)."""
        return {"input_ids": common.clip_tokens(tokenizer, caption, tokenizer.model_max_length)}

    def count_tokens(self, encoders: Any, caption: str, max_length: int) -> dict[str, tuple[int, int]]:
        """Tokens of the caption against what T5 reads. CLIP-L only gives the pooled vector from its
        first 77 tokens, as in FluxPipeline, so a longer caption is not cut off for FLUX."""
        _, t5_tok, _, _ = encoders
        return {"T5": (len(t5_tok(caption).input_ids), max_length)}

    # -- training ---------------------------------------------------------------------------
    def load_trainable(self, src: "ModelSource", cfg: Any, device: torch.device, dtype: torch.dtype,
                       swap: "SwapLayout") -> Any:
        trainable = model.load_trainable(src, cfg, device, dtype, swap, self.quantize_exclude, self.trainable)
        if cfg.lora.text_encoder:  # CLIP-L only: frozen here, the adapter comes with the transformer's
            trainable.text_encoders = {"text_encoder": self.load_clip(src, dtype).requires_grad_(False)}
        return trainable

    def load_clip(self, src: "ModelSource", dtype: torch.dtype) -> Any:
        from transformers import CLIPTextModel

        if src.files:
            from .._shared.singlefile.text import load_clip_l

            return load_clip_l(src.files["text_encoder"], src.root, dtype).eval()
        return own_module(CLIPTextModel.from_pretrained(src.root, subfolder="text_encoder", torch_dtype=dtype)).eval()

    def full_trainable(self, cfg: Any, dtype: torch.dtype, swap: "SwapLayout",
                       device: torch.device | None = None) -> Any:
        return model.full_trainable(cfg, dtype, swap, device, self, self.trainable)

    def meta_trainable(self, src: "ModelSource | None", cfg: Any, dtype: torch.dtype) -> Any:
        return model.meta_trainable(src.root if src is not None else None, cfg, dtype, self.trainable)

    def synthetic_batch(self, trainable: Any, resolution: int, cfg: Any, device: torch.device) -> dict[str, torch.Tensor]:
        return model.synthetic_batch(trainable, resolution, cfg, device)

    # -- block swapping ---------------------------------------------------------------------
    def block_counts(self, src: "ModelSource") -> list[int]:
        return swap.block_counts(src.root)

    def full_block_counts(self, cfg: Any) -> list[int]:
        return model.full_block_counts()

    def swap_counts(self, lengths: list[int], cfg: Any) -> list[int]:
        return swap.swap_counts(lengths, cfg)

    def with_blocks_to_swap(self, cfg: Any, n: int) -> Any:
        return swap.with_blocks_to_swap(cfg, n)

    # -- evaluation -------------------------------------------------------------------------
    def load_sampler(self, src: "ModelSource", denoiser: torch.nn.Module, cfg: Any, device: torch.device,
                     dtype: torch.dtype) -> Callable[..., Any]:
        # FLUX.1-dev is guidance-distilled: 3.5 is its usual embedded guidance at inference.
        sample = common.diffusers_sampler(self, src, denoiser, cfg, device, dtype, default_guidance=3.5)
        return model.masked_sampler(sample, denoiser) if self.text_options(cfg) else sample

    # -- export -----------------------------------------------------------------------------
    def export_tensors(self, modules: dict[str, Any], fmt: str,
                       base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return keys.tensors(modules, fmt, base)

    def file_base_weights(self, src: "ModelSource", component: str, paths: list[str]) -> dict[str, torch.Tensor]:
        return singlefile.base_weights(src, component, paths)

    def export_metadata(self, cfg: Any, record: dict[str, Any]) -> dict[str, Any]:
        return keys.metadata(cfg, record)

    def comfyui_nodes(self, lora_name: str, prompt: str, negative: str, seed: int, prefix: str,
                      with_clip: bool, model: Any = None) -> list[Any]:
        return comfyui.nodes(lora_name, prompt, negative, seed, prefix, with_clip=with_clip, model=model)


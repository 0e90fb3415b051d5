"""FLUX.2's trained module, loss and text encoding, for its two lines of models:

- FLUX.2 [klein] base (4B and 9B; ``Flux2KleinPipeline``): Qwen3 (4B, 8B) reads the caption in its
  chat template with thinking off, and the hidden states of its layers 9, 18 and 27 are stacked side
  by side per token; no guidance embedding (sampled with real classifier-free guidance).
- FLUX.2 [dev] (32B; ``Flux2Pipeline``): Mistral-Small-3 reads the caption after BFL's system
  message, its layers 10, 20 and 30 stacked the same way; a guidance embedding, fed 1.0 in training
  (as musubi-tuner, ai-toolkit, SimpleTuner and OneTrainer do) and the embedded guidance when sampling.

Both pad the caption to the pipeline's length and pass no mask: the transformer attends to the
padding, so the padded states are what is cached. The VAE (``AutoencoderKLFlux2``) gives 32
channels at 1/8; each 2×2 patch becomes 128 channels at 1/16, normalised by the VAE's batch-norm
statistics (no scaling factor); each latent pixel is one token (no further packing). The loss is
flow matching as FLUX.1 trains it: ``x_σ = (1 − σ) x0 + σ ε`` against ``ε − x0``, the transformer
given σ itself (it multiplies by 1000), with 4-axis position ids (time, row, column, token).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...errors import ModelSourceError
from ...models.tiny import random_init
from ...util.rng import draws
from .._shared import stream
from .._shared.flow_matching import flow_matching_loss, resolution_shift_mu, sample_sigmas

if TYPE_CHECKING:
    from ...memory.swap import SwapLayout
    from ...models.source import ModelSource

CONFIGS = Path(__file__).parent / "configs"
MODELS = {"klein": CONFIGS / "flux2-klein-base-4b", "dev": CONFIGS / "flux2-dev"}
MODEL_CLASS = "Flux2Transformer2DModel"
BLOCKS = {"double": "transformer_blocks", "single": "single_transformer_blocks"}
TEXT_MAX_LENGTH = 512  # both pipelines' max_sequence_length: every caption is padded to it
# Flux2KleinPipeline._get_qwen3_prompt_embeds: the chat template's text for one user message, with
# the generation prompt and enable_thinking=False (the empty think block).
KLEIN_TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
KLEIN_LAYERS = (9, 18, 27)
DEV_LAYERS = (10, 20, 30)
# BFL's system message for FLUX.2 [dev] (flux2 system_messages.py; diffusers' pipeline), newline included.
DEV_SYSTEM = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
              "object relationships, object\nattribution and actions without speculation.")
TRAINING_GUIDANCE = 1.0  # the guidance embedding's input in training (dev), as every peer feeds it


def variant(root: Path) -> str:
    """"klein" or "dev", from the model folder's pipeline class."""
    name = json.loads((root / "model_index.json").read_text()).get("_class_name", "")
    if name == "Flux2KleinPipeline":
        return "klein"
    if name == "Flux2Pipeline":
        return "dev"
    raise ModelSourceError(f"{root}/model_index.json: {name!r} is not a FLUX.2 pipeline (Flux2Pipeline for "
                           "FLUX.2 [dev], Flux2KleinPipeline for FLUX.2 [klein])")


def block_counts(root: Path) -> list[int]:
    c = json.loads((root / "transformer" / "config.json").read_text())
    return [int(c.get("num_layers", 8)), int(c.get("num_single_layers", 48))]


def swap_counts(lengths: list[int], n: int) -> list[int]:
    """``memory.blocks_to_swap`` blocks, the last ones in execution order: single blocks first (from
    the end), then double blocks."""
    single = min(n, lengths[1])
    return [min(n - single, lengths[0]), single]


def load_trainable(src: "ModelSource", cfg: Any, device: torch.device, dtype: torch.dtype, layout: "SwapLayout",
                   quantize_exclude: tuple[str, ...]) -> "Flux2Trainable":
    """Read block by block (``_shared.stream``): each block quantized with memory.fp8 and placed as it
    is read, so the host never holds the whole transformer in its load dtype (from a diffusers folder
    or from BFL's single file: ``singlefile.load_transformer``)."""
    from functools import partial

    from . import singlefile

    transformer, facts = stream.load_transformer(src, cfg, dtype, device, layout, quantize_exclude,
                                                 model_class=MODEL_CLASS,
                                                 file_reader=partial(singlefile.load_transformer, blocks=BLOCKS),
                                                 blocks=BLOCKS)
    trainable = _trainable(transformer, cfg)
    trainable.facts.update(facts, variant=variant(src.root))
    return trainable


def full_trainable(cfg: Any, dtype: torch.dtype, layout: "SwapLayout", device: torch.device | None = None, family: Any = None,
                   root: Path | None = None) -> "Flux2Trainable":
    """The real architecture (``root``: the preset's model, else FLUX.2 [klein] base 4B) with random
    weights, for benchmarks (made block by block on CUDA)."""
    from .._shared.diffusers_image import builds_on_device, random_on_device

    transformer = _meta(root or MODELS["klein"], dtype)
    facts: dict[str, Any] = {}
    if builds_on_device(device):
        parts = [f"{name}.{i}" for name in BLOCKS.values() for i in range(len(getattr(transformer, name)))]
        transformer, facts = random_on_device(family, transformer, cfg, dtype, device, parts, layout)
    else:
        transformer = random_init(transformer, dtype)
    trainable = _trainable(transformer, cfg)
    if facts:
        trainable.facts["full_build"] = facts
    return trainable


def meta_trainable(root: Path | None, cfg: Any, dtype: torch.dtype) -> "Flux2Trainable":
    return _trainable(_meta(root or MODELS["klein"], dtype).requires_grad_(False), cfg)


def _meta(root: Path, dtype: torch.dtype) -> Any:
    from diffusers import Flux2Transformer2DModel

    from ...models.safefiles import diffusers_config

    config = diffusers_config(Flux2Transformer2DModel, root, "transformer")
    with torch.device("meta"):
        return torch.nn.Module.to(Flux2Transformer2DModel.from_config(config), dtype)


def _trainable(transformer: Any, cfg: Any) -> "Flux2Trainable":
    if cfg.memory.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    return Flux2Trainable(transformer, cfg.family, cfg.train)


def synthetic_batch(trainable: "Flux2Trainable", resolution: int, cfg: Any,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """Random tensors shaped like one cached sample (the caption padded to the cache's length)."""
    c = trainable.model.config
    n, r = cfg.train.batch_size, resolution
    length = cfg.cache.text_max_length or TEXT_MAX_LENGTH
    g = torch.Generator().manual_seed(0)
    return {k: v.to(device) for k, v in {
        "latents": torch.randn(n, c.in_channels, r // 16, r // 16, generator=g),
        "prompt_embeds": torch.randn(n, length, c.joint_attention_dim, generator=g),
    }.items()}


def mistral_tokenizer(folder: Path) -> Any:
    """[dev]'s tokenizer with its chat template, without the Pixtral processor around it: for text
    alone the processor renders the same template and tokenizes with this tokenizer (and
    transformers builds that processor only with torchvision, which nothing else here needs)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not tokenizer.chat_template:  # (kept beside the processor's config rather than the tokenizer's)
        for name in ("chat_template.jinja", "chat_template.json"):
            path = folder / name
            if path.is_file():
                text = path.read_text(encoding="utf-8")
                tokenizer.chat_template = json.loads(text)["chat_template"] if name.endswith(".json") else text
                break
        else:
            raise ModelSourceError(f"{folder}: no chat template for Mistral's tokenizer (chat_template.jinja, "
                                   "chat_template.json or the tokenizer's config); FLUX.2 [dev]'s captions are "
                                   "encoded inside it")
    return tokenizer


def encode_caption(tokenizer: Any, encoder: Any, caption: str, max_length: int, kind: str) -> torch.Tensor:
    """[max_length, 3·hidden]: the caption's states as the pipeline encodes one prompt: Klein's
    Qwen3 chat template (thinking off) or dev's system message and Mistral chat template, padded to
    ``max_length``, three layers' hidden states side by side per token."""
    if kind == "klein":
        t = tokenizer(KLEIN_TEMPLATE.format(caption), return_tensors="pt", padding="max_length", truncation=True,
                      max_length=max_length)
        layers = KLEIN_LAYERS
    else:
        messages = [[{"role": "system", "content": [{"type": "text", "text": DEV_SYSTEM}]},
                     {"role": "user", "content": [{"type": "text", "text": caption.replace("[IMG]", "")}]}]]
        t = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, return_dict=True,
                                          return_tensors="pt", padding="max_length", truncation=True,
                                          max_length=max_length)
        layers = DEV_LAYERS
    out = encoder(input_ids=t["input_ids"].to(encoder.device), attention_mask=t["attention_mask"].to(encoder.device),
                  output_hidden_states=True, use_cache=False)
    states = torch.stack([out.hidden_states[k][0] for k in layers], dim=1)  # [L, 3, hidden]
    return states.reshape(states.shape[0], -1)


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] → [B, 4C, H/2, W/2]: each 2×2 patch as channels (c·4 + row·2 + column)."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def normalize(latents: torch.Tensor, bn: Any) -> torch.Tensor:
    """Patchified latents normalised by the VAE's batch-norm statistics, as the pipeline and the
    training script do."""
    mean = bn.running_mean.view(1, -1, 1, 1).to(latents)
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1).to(latents) + bn.eps)
    return (latents - mean) / std


def tokens(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] → [B, h·w, C]: one token per latent pixel, row by row (the pipeline's _pack_latents)."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def image_ids(h: int, w: int, device: torch.device) -> torch.Tensor:
    """[1, h·w, 4]: (time 0, row, column, 0) per token, as _prepare_latent_ids."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    zero = torch.zeros(h * w, dtype=torch.long)
    return torch.stack([zero, rows.flatten(), cols.flatten(), zero], dim=1)[None].to(device)


def text_ids(length: int, device: torch.device) -> torch.Tensor:
    """[1, L, 4]: (0, 0, 0, token index), as _prepare_text_ids."""
    ids = torch.zeros(length, 4, dtype=torch.long)
    ids[:, 3] = torch.arange(length)
    return ids[None].to(device)


class Flux2Trainable:
    """The FLUX.2 transformer and the flow-matching loss on cached latents and caption states."""

    def __init__(self, transformer: Any, settings: Any, train: Any = None):
        self.model = transformer
        self.settings = settings
        self.train = train  # [train]: the loss type (None: l2)
        self.facts: dict[str, Any] = {}

    def loss(self, batch: dict[str, torch.Tensor], generator: Any) -> torch.Tensor:
        latents = batch["latents"]
        n, _, h, w = latents.shape
        x0 = tokens(latents)
        noise = draws(generator).randn(x0.shape, device=latents.device, dtype=x0.dtype)
        sigma = sample_sigmas(n, self.settings, h * w, generator, latents.device, resolution_shift_mu)
        s = sigma.view(n, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        dtype, device = self.model.dtype, latents.device
        embeds = batch["prompt_embeds"].to(dtype)
        guidance = None
        if self.model.config.guidance_embeds:
            guidance = torch.full((n,), TRAINING_GUIDANCE, device=device, dtype=dtype)
        pred = self.model(hidden_states=noisy.to(dtype), encoder_hidden_states=embeds, timestep=sigma.to(dtype),
                          img_ids=image_ids(h, w, device), txt_ids=text_ids(embeds.shape[1], device),
                          guidance=guidance, return_dict=False)[0]
        return flow_matching_loss(self.settings, batch, pred, noise, x0, sigma, self.train, layout=tokens)

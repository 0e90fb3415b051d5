"""Krea 2's trained module, loss and text encoding.

The transformer (``Krea2Transformer2DModel``, 12.8B) is one stream of 28 blocks over the caption's
and the image's tokens. The caption comes from Qwen3-VL-4B inside Qwen-Image's chat template: the
hidden states of twelve of its layers (2, 5, ..., 35), stacked per token as ``[L, 12, 2560]`` (the
transformer's text fusion blocks mix them), the template's 34 leading tokens dropped. The pipeline
pads the prompt in the middle of the template (``[prefix | prompt | PAD | suffix]``) with positions
that skip the padding and masks the padding everywhere after, so a caption's states are its real
tokens' alone: the cache keeps those, each caption its own length, and ``collate`` pads a batch of
captions of other lengths with a mask (text positions in the transformer are all zero, so where the
padding sits does not matter). Latents are Qwen-Image's VAE's, ``(z − mean) / std`` per channel,
packed in 2×2 patches; the loss is FLUX.1's flow matching (the transformer is given σ and predicts
``ε − x0``), timesteps shifted by e^mu with mu linear in the token count (0.5 at 256 tokens, 1.15 at
6400: the pipeline's schedule, musubi-tuner's ``krea2_shift``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...models.tiny import random_init
from .._shared import one_stream, stream
from .._shared.flow_matching import flow_matching_loss, noised

if TYPE_CHECKING:
    from ...memory.swap import SwapLayout
    from ...models.source import ModelSource

CONFIGS = Path(__file__).parent / "configs" / "krea-2-raw"
MODEL_CLASS = "Krea2Transformer2DModel"
BLOCKS = {"block": "transformer_blocks"}
# Krea2Pipeline's template: the prompt between the prefix and the suffix; the prefix's 34 tokens dropped.
PREFIX = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
          "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
PREFIX_TOKENS = 34
SUFFIX_TOKENS = 5
LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)  # the pipeline's text_encoder_select_layers
TEXT_MAX_LENGTH = 512  # the pipeline's max_sequence_length: the prompt's and the suffix's tokens
PLAN_TEXT_TOKENS = 256


def block_counts(root: Path) -> list[int]:
    return [one_stream.block_count(root, 28)]


def shift_mu(root: Path | None) -> Callable[[int], float]:
    """The pipeline's shift: mu linear in the image's token count, from the model's scheduler config."""
    return one_stream.scheduler_shift(root, CONFIGS, default_max=(6400, 1.15))


def keep_fp32(transformer: Any) -> Any:
    """The model's norms in float32 (its ``_keep_in_fp32_modules``, which from_pretrained would honour)."""
    keep = set(getattr(transformer, "_keep_in_fp32_modules", None) or ())
    for name, m in transformer.named_modules():
        if name.rsplit(".", 1)[-1] in keep and not any(p.is_meta for p in m.parameters()):
            m.float()
    return transformer


def load_trainable(src: "ModelSource", cfg: Any, device: torch.device, dtype: torch.dtype, layout: "SwapLayout",
                   quantize_exclude: tuple[str, ...]) -> "Krea2Trainable":
    """Read block by block (``_shared.stream``): each block quantized with memory.fp8 and placed as it is
    read (from a diffusers folder, or from Krea's single file: ``singlefile.load_transformer``)."""
    from functools import partial

    from . import singlefile

    transformer, facts = stream.load_transformer(src, cfg, dtype, device, layout, quantize_exclude,
                                                 model_class=MODEL_CLASS,
                                                 file_reader=partial(singlefile.load_transformer, blocks=BLOCKS),
                                                 blocks=BLOCKS)
    trainable = _trainable(keep_fp32(transformer), cfg, src.root)
    trainable.facts.update(facts)
    return trainable


def full_trainable(cfg: Any, dtype: torch.dtype, layout: "SwapLayout", device: torch.device | None = None, family: Any = None) -> "Krea2Trainable":
    from .._shared.diffusers_image import builds_on_device, random_on_device

    transformer = _meta(CONFIGS, dtype)
    facts: dict[str, Any] = {}
    if builds_on_device(device):
        parts = [f"transformer_blocks.{i}" for i in range(len(transformer.transformer_blocks))]
        transformer, facts = random_on_device(family, transformer, cfg, dtype, device, parts, layout)
    else:
        transformer = random_init(transformer, dtype)
    trainable = _trainable(keep_fp32(transformer), cfg, None)
    if facts:
        trainable.facts["full_build"] = facts
    return trainable


def meta_trainable(root: Path | None, cfg: Any, dtype: torch.dtype) -> "Krea2Trainable":
    return _trainable(_meta(root or CONFIGS, dtype).requires_grad_(False), cfg, root)


def _meta(root: Path, dtype: torch.dtype) -> Any:
    from diffusers import Krea2Transformer2DModel

    from ...models.safefiles import diffusers_config

    config = diffusers_config(Krea2Transformer2DModel, root, "transformer")
    with torch.device("meta"):
        return torch.nn.Module.to(Krea2Transformer2DModel.from_config(config), dtype)


def _trainable(transformer: Any, cfg: Any, root: Path | None) -> "Krea2Trainable":
    if cfg.memory.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    return Krea2Trainable(transformer, cfg.family, cfg.train, shift_mu(root))


def synthetic_batch(trainable: "Krea2Trainable", resolution: int, cfg: Any, device: torch.device) -> dict[str, torch.Tensor]:
    c = trainable.model.config
    n, r = cfg.train.batch_size, resolution
    length = min(cfg.cache.text_max_length or TEXT_MAX_LENGTH, PLAN_TEXT_TOKENS)
    g = torch.Generator().manual_seed(0)
    return {k: v.to(device) for k, v in {
        "latents": torch.randn(n, c.in_channels // 4, r // 8, r // 8, generator=g),
        "prompt_embeds": torch.randn(n, length, c.num_text_layers, c.text_hidden_dim, generator=g),
    }.items()}


collate = one_stream.collate_captions  # (the transformer masks the padding, as the pipeline's)


def encode_caption(tokenizer: Any, encoder: Any, caption: str, max_length: int) -> torch.Tensor:
    """[L, 12, hidden]: the caption's real tokens' states as Krea2Pipeline.get_text_hidden_states
    computes them for one prompt: the prefix and prompt cut at ``max_length`` + 34 − 5 tokens, the
    suffix after them, positions counting real tokens only, twelve layers stacked, the prefix dropped."""
    text = tokenizer(PREFIX + caption, truncation=True, max_length=max_length + PREFIX_TOKENS - SUFFIX_TOKENS,
                     return_tensors="pt")
    suffix = tokenizer(SUFFIX, return_tensors="pt")
    ids = torch.cat([text.input_ids, suffix.input_ids], dim=1).to(encoder.device)
    positions = torch.arange(ids.shape[1], device=encoder.device)[None, None].expand(3, 1, -1)
    out = encoder(input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool), position_ids=positions,
                  output_hidden_states=True)
    return torch.stack([out.hidden_states[i][0] for i in LAYERS], dim=1)[PREFIX_TOKENS:]


def normalize_latents(latents: torch.Tensor, vae_config: Any) -> torch.Tensor:
    """[B, C, 1, h, w] VAE means → [B, C, h, w]: ``(z − mean) / std`` per channel (ai-toolkit's,
    OneTrainer's and musubi-tuner's encoding; the pipeline decodes with the inverse)."""
    mean = torch.tensor(vae_config.latents_mean).view(1, -1, 1, 1, 1).to(latents)
    std = torch.tensor(vae_config.latents_std).view(1, -1, 1, 1, 1).to(latents)
    return ((latents - mean) / std)[:, :, 0]


def position_ids(text_len: int, h: int, w: int, device: torch.device) -> torch.Tensor:
    """[L + (h/2)(w/2), 3]: text at the origin, image tokens at (0, row, column) of the 2×2-patch grid
    (Krea2Pipeline.prepare_position_ids)."""
    rows, cols = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
    image = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)
    return torch.cat([torch.zeros(text_len, 3), image.float()]).to(device)


class Krea2Trainable:
    """The Krea 2 transformer and the flow-matching loss on cached latents and caption states."""

    def __init__(self, transformer: Any, settings: Any, train: Any = None, mu: Callable[[int], float] | None = None):
        self.model = transformer
        self.settings = settings
        self.train = train
        self.shift_mu = mu or shift_mu(None)
        self.facts: dict[str, Any] = {"variant": "krea-2"}

    def loss(self, batch: dict[str, torch.Tensor], generator: Any) -> torch.Tensor:
        latents = batch["latents"]
        _, _, h, w = latents.shape
        x0, noise, sigma, noisy = noised(self.settings, latents, generator, self.shift_mu)
        dtype = self.model.dtype
        embeds = batch["prompt_embeds"].to(dtype)
        pred = self.model(hidden_states=noisy.to(dtype), encoder_hidden_states=embeds, timestep=sigma.to(dtype),
                          position_ids=position_ids(embeds.shape[1], h, w, latents.device),
                          encoder_attention_mask=batch.get("prompt_mask"), return_dict=False)[0]
        return flow_matching_loss(self.settings, batch, pred, noise, x0, sigma, self.train)

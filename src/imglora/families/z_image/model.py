"""Z-Image's trained module, loss and text encoding.

The transformer (``ZImageTransformer2DModel``, 6.2B) is one stream: two ``noise_refiner`` blocks
for the image tokens, two ``context_refiner`` blocks for the caption's, then 30 ``layers`` over both.
It patchifies the latents itself (2×2), takes lists (one latent ``[C, 1, h, w]`` and one caption
``[L, 2560]`` per sample, each its own length) and a time ``t = 1 − σ`` (1 = clean; it multiplies by
1000 itself), and its output is the negative of the flow: ZImagePipeline negates it before the
scheduler step (``noise_pred = -noise_pred``). So the loss here is flow matching as FLUX.1 trains,
``x_σ = (1 − σ) x0 + σ ε`` against ``ε − x0``, with the prediction ``−transformer(x_σ, 1 − σ)`` (as the
diffusers training script, ai-toolkit and SimpleTuner compute it).

Captions go through Qwen3-4B inside the chat template the pipeline applies (``apply_chat_template``
with ``add_generation_prompt`` and ``enable_thinking``: no think block), the second-to-last hidden
states, the padding dropped: each caption keeps its own length (``collate`` pads a batch of them and
the loss gives the transformer each one unpadded, as the pipeline does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...models.tiny import random_init
from .._shared import one_stream, stream
from .._shared.flow_matching import flow_matching_loss, noised, pack_latents

if TYPE_CHECKING:
    from ...memory.swap import SwapLayout
    from ...models.source import ModelSource

CONFIGS = Path(__file__).parent / "configs" / "z-image-turbo"
MODEL_CLASS = "ZImageTransformer2DModel"
# Its block lists in execution order ({kind: attribute}); lora.blocks' kinds and the streamed reader's.
BLOCKS = {"noise": "noise_refiner", "context": "context_refiner", "layer": "layers"}
# ZImagePipeline._encode_prompt: Qwen3's chat template for one user message, with the generation
# prompt and enable_thinking=True (which adds no think block).
TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
TEMPLATE_TOKENS = 5  # "<|im_end|>", "\n", "<|im_start|>", "assistant", "\n" after the caption; 3 before it
TEXT_MAX_LENGTH = 512  # the pipeline's max_sequence_length: tokens of the templated caption
PLAN_TEXT_TOKENS = 256  # a long caption's tokens, for planning and benchmarks
HIDDEN_LAYER = -2  # the second-to-last hidden states (before the last layer; ComfyUI's layer_idx=-2)


def block_counts(root: Path) -> list[int]:
    """Blocks per list (noise refiner, context refiner, layers), from the transformer's config."""
    c = json.loads((root / "transformer" / "config.json").read_text())
    refiners = int(c.get("n_refiner_layers", 2))
    return [refiners, refiners, int(c.get("n_layers", 30))]


def load_trainable(src: "ModelSource", cfg: Any, device: torch.device, dtype: torch.dtype, layout: "SwapLayout",
                   quantize_exclude: tuple[str, ...]) -> "ZImageTrainable":
    """Read block by block (``_shared.stream``): each block quantized with memory.fp8 and placed as it
    is read; the quantized model kept in the cache for the next run."""
    from functools import partial

    from . import singlefile

    transformer, facts = stream.load_transformer(src, cfg, dtype, device, layout, quantize_exclude,
                                                 model_class=MODEL_CLASS,
                                                 file_reader=partial(singlefile.load_transformer, blocks=BLOCKS),
                                                 blocks=BLOCKS)
    trainable = _trainable(transformer, cfg)
    trainable.facts.update(facts)
    return trainable


def full_trainable(cfg: Any, dtype: torch.dtype, layout: "SwapLayout", device: torch.device | None = None,
                   family: Any = None) -> "ZImageTrainable":
    """The real Z-Image transformer architecture (6.2B) with random weights, for benchmarks (made block
    by block on CUDA: ``diffusers_image.random_on_device``)."""
    from .._shared.diffusers_image import builds_on_device, random_on_device

    transformer = _meta(CONFIGS, dtype)
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


def meta_trainable(root: Path | None, cfg: Any, dtype: torch.dtype) -> "ZImageTrainable":
    """The transformer of ``root`` (None: Z-Image's shipped config) on the meta device, frozen."""
    return _trainable(_meta(root or CONFIGS, dtype).requires_grad_(False), cfg)


def _meta(root: Path, dtype: torch.dtype) -> Any:
    from diffusers import ZImageTransformer2DModel

    from ...models.safefiles import diffusers_config

    config = diffusers_config(ZImageTransformer2DModel, root, "transformer")
    with torch.device("meta"):
        return torch.nn.Module.to(ZImageTransformer2DModel.from_config(config), dtype)


def _trainable(transformer: Any, cfg: Any) -> "ZImageTrainable":
    if cfg.memory.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    return ZImageTrainable(transformer, cfg.family, cfg.train)


def synthetic_batch(trainable: "ZImageTrainable", resolution: int, cfg: Any,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """Random tensors shaped like one cached sample (a long caption: PLAN_TEXT_TOKENS, or the cache's
    token length when it is shorter)."""
    c = trainable.model.config
    n, r = cfg.train.batch_size, resolution
    length = min(cfg.cache.text_max_length or TEXT_MAX_LENGTH, PLAN_TEXT_TOKENS)
    g = torch.Generator().manual_seed(0)
    return {k: v.to(device) for k, v in {
        "latents": torch.randn(n, c.in_channels, r // 8, r // 8, generator=g),
        "prompt_embeds": torch.randn(n, length, c.cap_feat_dim, generator=g),
    }.items()}


collate = one_stream.collate_captions  # (the loss hands the transformer each caption unpadded)


def encode_caption(tokenizer: Any, encoder: Any, caption: str, max_length: int) -> torch.Tensor:
    """[L, 2560]: the caption's hidden states as ZImagePipeline._encode_prompt computes them for one
    prompt: the templated text cut at ``max_length`` tokens, Qwen3's second-to-last hidden states of
    its tokens (the pipeline pads to ``max_length`` on the right and drops the padding afterwards;
    Qwen3 is causal, so the tokens' states are the same without it)."""
    t = tokenizer(TEMPLATE.format(caption), max_length=max_length, truncation=True, return_tensors="pt")
    out = encoder(input_ids=t.input_ids.to(encoder.device), attention_mask=t.attention_mask.to(encoder.device),
                  output_hidden_states=True)
    return out.hidden_states[HIDDEN_LAYER][0]


def unpacked(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, (h/2)(w/2), 4C] → [B, C, h, w]: the inverse of ``pack_latents``."""
    b, _, d = tokens.shape
    c = d // 4
    return tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


class ZImageTrainable:
    """The Z-Image transformer and the flow-matching loss on cached latents and caption states."""

    def __init__(self, transformer: Any, settings: Any, train: Any = None):
        self.model = transformer
        self.settings = settings
        self.train = train  # [train]: the loss type (None: l2)
        self.facts: dict[str, Any] = {"variant": "z-image"}

    def loss(self, batch: dict[str, torch.Tensor], generator: Any) -> torch.Tensor:
        latents = batch["latents"]
        n, _, h, w = latents.shape
        x0, noise, sigma, noisy = noised(self.settings, latents, generator)
        dtype = self.model.dtype
        embeds, mask = batch["prompt_embeds"].to(dtype), batch.get("prompt_mask")
        captions = [embeds[i] if mask is None else embeds[i][mask[i]] for i in range(n)]
        out = self.model(list(unpacked(noisy, h, w).to(dtype).unsqueeze(2).unbind(0)), (1 - sigma).to(dtype),
                         captions, return_dict=False)[0]
        pred = -pack_latents(torch.stack(out).squeeze(2))  # the pipeline's noise_pred = -noise_pred
        return flow_matching_loss(self.settings, batch, pred, noise, x0, sigma, self.train)

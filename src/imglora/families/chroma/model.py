"""Chroma's trained module and loss: FLUX.1's flow matching on packed latents (``noise - x0``, the
same packing and position ids), with T5 alone as the text, no guidance and no pooled vector, and
the text's attention mask: every T5 token of the caption plus its first padding token attends,
the rest of the padding does not (ChromaPipeline's rule; ai-toolkit's and SimpleTuner's boolean
mask — diffusers' pipeline builds it as floats, which adds to the scores instead of masking).

diffusers' ChromaTransformer2DModel drops the mask in its single blocks under gradient
checkpointing (it calls them with three positional inputs), so the trainable hands each single
block the step's mask itself (a forward pre-hook that fills in a missing ``attention_mask``):
training with and without checkpointing computes the same (tested)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...models.tiny import random_init
from .._shared import stream
from ..flux import swap
from ..flux.singlefile import BLOCKS
from . import singlefile
from .._shared.flow_matching import flow_matching_loss, noised
from ..flux.model import image_ids

if TYPE_CHECKING:
    from ...memory.swap import SwapLayout
    from ...models.source import ModelSource

CONFIGS = Path(__file__).parent / "configs" / "chroma1-hd"
TEXT_MAX_LENGTH = 512  # T5 tokens, as ChromaPipeline encodes prompts


def load_trainable(src: "ModelSource", cfg: Any, device: torch.device, dtype: torch.dtype, layout: "SwapLayout",
                   quantize_exclude: tuple[str, ...]) -> "ChromaTrainable":
    """Read block by block as FLUX.1's transformer is (``_shared.stream``): each block quantized with
    memory.fp8 and placed as it is read, the quantized model kept in the cache for the next run."""
    transformer, facts = stream.load_transformer(src, cfg, dtype, device, layout, quantize_exclude,
                                                 model_class="ChromaTransformer2DModel",
                                                 file_reader=singlefile.load_chroma_transformer, blocks=BLOCKS)
    trainable = _trainable(with_mod_proj(transformer), cfg)
    trainable.facts.update(facts)
    return trainable


def full_trainable(cfg: Any, dtype: torch.dtype, layout: "SwapLayout", device: torch.device | None = None, family: Any = None) -> "ChromaTrainable":
    """The real Chroma1-HD transformer architecture (8.9B) with random weights, for benchmarks (made
    block by block on CUDA, as FLUX.1's: ``diffusers_image.random_on_device``)."""
    from .._shared.diffusers_image import builds_on_device, random_on_device

    transformer = _meta(CONFIGS, dtype)
    facts: dict[str, Any] = {}
    if builds_on_device(device):
        parts = [f"{name}.{i}" for name in swap.BLOCK_LISTS for i in range(len(getattr(transformer, name)))]
        transformer, facts = random_on_device(family, transformer, cfg, dtype, device, parts, layout)
    else:
        transformer = random_init(transformer, dtype)
    trainable = _trainable(with_mod_proj(transformer), cfg)
    if facts:
        trainable.facts["full_build"] = facts
    return trainable


def meta_trainable(root: "Path | None", cfg: Any, dtype: torch.dtype) -> "ChromaTrainable":
    """The transformer of ``root`` (None: Chroma1-HD's shipped config) on the meta device, frozen."""
    return _trainable(_meta(root or CONFIGS, dtype).requires_grad_(False), cfg)


def with_mod_proj(transformer: Any) -> Any:
    """The approximator's fixed input table (``time_text_embed.mod_proj``, a buffer diffusers computes
    when the module is made and never saves), made again for a model built on the meta device: after
    its weights were loaded (read block by block, or from the quantized cache) it is still on the meta
    device; after random weights (``to_empty``) it holds uninitialised memory. In the model's dtype
    and beside its weights, as ``from_pretrained(torch_dtype=...)`` leaves it."""
    embed = transformer.time_text_embed
    c = transformer.config
    fresh = type(embed)(num_channels=c.approximator_num_channels // 4,
                        out_dim=3 * c.num_single_layers + 2 * 6 * c.num_layers + 2).mod_proj
    where = transformer.x_embedder.weight
    embed.register_buffer("mod_proj", fresh.to(where.device, transformer.dtype), persistent=False)
    return transformer


def _meta(root: Path, dtype: torch.dtype) -> Any:
    from diffusers import ChromaTransformer2DModel

    from ...models.safefiles import diffusers_config

    config = diffusers_config(ChromaTransformer2DModel, root, "transformer")
    with torch.device("meta"):
        return torch.nn.Module.to(ChromaTransformer2DModel.from_config(config), dtype)


def _trainable(transformer: Any, cfg: Any) -> "ChromaTrainable":
    if cfg.memory.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    return ChromaTrainable(transformer, cfg.family, cfg.train)


def synthetic_batch(trainable: "ChromaTrainable", resolution: int, cfg: Any,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """Random tensors shaped like one cached sample (a caption as long as the token length)."""
    c = trainable.model.config
    n, r = cfg.train.batch_size, resolution
    length = cfg.cache.text_max_length or TEXT_MAX_LENGTH
    g = torch.Generator().manual_seed(0)
    return {k: v.to(device) for k, v in {
        "latents": torch.randn(n, c.in_channels // 4, r // 8, r // 8, generator=g),
        "prompt_embeds": torch.randn(n, length, c.joint_attention_dim, generator=g),
        "text_mask": torch.ones(n, length, dtype=torch.bool),
    }.items()}


def text_mask(tokenizer_mask: torch.Tensor) -> torch.Tensor:
    """[L] bool: the caption's tokens (its EOS included) and the first padding token, as
    ChromaPipeline's ``mask_indices <= seq_lengths``."""
    return torch.arange(tokenizer_mask.shape[-1]) <= tokenizer_mask.sum(-1, keepdim=True)


class ChromaTrainable:
    def __init__(self, transformer: Any, settings: Any, train: Any = None):
        self.model = transformer
        self.settings = settings
        self.train = train  # [train]: the loss type (None: l2)
        self.facts: dict[str, Any] = {"variant": "chroma"}
        self.mask: torch.Tensor | None = None  # this step's attention mask, for the single blocks
        for block in transformer.single_transformer_blocks:
            block.register_forward_pre_hook(self._with_mask, with_kwargs=True)

    def _with_mask(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kwargs.get("attention_mask") is None and self.mask is not None and len(args) < 4:  # (not positional)
            return args, {**kwargs, "attention_mask": self.mask}
        return None

    def loss(self, batch: dict[str, torch.Tensor], generator: Any) -> torch.Tensor:
        latents = batch["latents"]
        device, (n, _, h, w) = latents.device, latents.shape
        x0, noise, sigma, noisy = noised(self.settings, latents, generator)
        dtype = self.model.dtype
        text = batch["prompt_embeds"]
        self.mask = torch.cat([batch["text_mask"].bool(), torch.ones(n, x0.shape[1], dtype=torch.bool,
                                                                      device=device)], dim=1)
        pred = self.model(
            hidden_states=noisy.to(dtype),
            encoder_hidden_states=text.to(dtype),
            timestep=sigma.to(dtype),  # the transformer multiplies by 1000 itself
            img_ids=image_ids(h, w, device).to(dtype),
            txt_ids=torch.zeros(text.shape[1], 3, device=device, dtype=dtype),
            attention_mask=self.mask,
            return_dict=False,
        )[0]
        return flow_matching_loss(self.settings, batch, pred, noise, x0, sigma, self.train)

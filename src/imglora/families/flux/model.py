"""FLUX.1's trained module and loss: flow matching on packed 2×2 latent patches with image/text
position ids, target ``noise - latents``, the guidance embedding, timestep sampling as kohya does."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...models.tiny import random_init
from .._shared import stream
from . import singlefile, swap
from .._shared.flow_matching import (flow_matching_loss, noised, pack_latents,  # noqa: F401 (FLUX's own)
                                      resolution_shift_mu, sample_sigmas)

if TYPE_CHECKING:
    from ...memory.swap import SwapLayout
    from ...models.source import ModelSource


def load_trainable(src: "ModelSource", cfg: Any, device: torch.device, dtype: torch.dtype, layout: "SwapLayout",
                   quantize_exclude: tuple[str, ...], cls: type | None = None) -> "FluxTrainable":

    # Streamed from a file or a folder alike: each block quantized and placed as it is read.
    transformer, facts = stream.load_transformer(src, cfg, dtype, device, layout, quantize_exclude,
                                                 model_class="FluxTransformer2DModel",
                                                 file_reader=singlefile.load_flux_transformer, blocks=singlefile.BLOCKS)
    if cfg.memory.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    trainable = (cls or FluxTrainable)(transformer, cfg.family, cfg.train)
    trainable.facts.update(facts)
    return trainable


def full_trainable(cfg: Any, dtype: torch.dtype, layout: "SwapLayout", device: torch.device | None = None, family: Any = None,
                   cls: type | None = None) -> "FluxTrainable":
    """The real FLUX.1-dev transformer architecture (12B) with random weights, for benchmarks.

    On CUDA the weights are made on the GPU block by block, each block quantized there with
    ``memory.fp8`` and moved to the host right away if ``layout`` swaps it
    (``diffusers_image.random_on_device``; ``family`` gives the exclusions).
    Elsewhere the whole model is made on the host, as before, and quantized and placed later."""
    from diffusers import FluxTransformer2DModel

    from .._shared.diffusers_image import builds_on_device, random_on_device

    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**FULL_TRANSFORMER)
    facts: dict[str, Any] = {}
    if builds_on_device(device):
        parts = [f"{name}.{i}" for name in swap.BLOCK_LISTS for i in range(len(getattr(transformer, name)))]
        transformer, facts = random_on_device(family, transformer, cfg, dtype, device, parts, layout)
    else:
        transformer = random_init(transformer, dtype)
    if cfg.memory.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    trainable = (cls or FluxTrainable)(transformer, cfg.family, cfg.train)
    if facts:
        trainable.facts["full_build"] = facts
    return trainable


def synthetic_batch(trainable: "FluxTrainable", resolution: int, cfg: Any,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """Random tensors shaped like one cached sample, for benchmarks without a cache."""
    c = trainable.model.config
    n, r = cfg.train.batch_size, resolution
    length = cfg.cache.text_max_length or (TEXT_MAX_LENGTH if c.guidance_embeds else SCHNELL_TEXT_MAX_LENGTH)
    g = torch.Generator().manual_seed(0)
    pooled = {"input_ids": torch.zeros(n, 77, dtype=torch.long)} if trainable.text_encoders else {
        "pooled_prompt_embeds": torch.randn(n, c.pooled_projection_dim, generator=g)}  # (trained CLIP-L: tokens)
    return {k: v.to(device) for k, v in {
        "latents": torch.randn(n, c.in_channels // 4, r // 8, r // 8, generator=g),
        "prompt_embeds": torch.randn(n, length, c.joint_attention_dim, generator=g), **pooled,
        "time_ids": torch.zeros(n, 6),
    }.items()}


TEXT_MAX_LENGTH = 512  # T5 tokens, as FluxPipeline encodes prompts for FLUX.1-dev
SCHNELL_TEXT_MAX_LENGTH = 256  # FLUX.1-schnell's (its pipeline's limit; kohya's default for it)

# FluxTransformer2DModel's defaults are FLUX.1-dev's (19 double + 38 single blocks, 3072 wide);
# dev also has the guidance embedding. Used by `bench-swap --arch full` before a download.
FULL_TRANSFORMER: dict[str, Any] = {"guidance_embeds": True}


def full_block_counts() -> list[int]:
    """Double and single blocks of :data:`FULL_TRANSFORMER` (diffusers' defaults: FLUX.1's 19 and 38)."""
    return [FULL_TRANSFORMER.get("num_layers", 19), FULL_TRANSFORMER.get("num_single_layers", 38)]


def image_ids(h: int, w: int, device: torch.device) -> torch.Tensor:
    """Position ids of the packed latent tokens: (0, row, column), as FluxPipeline builds them."""
    ids = torch.zeros(h // 2, w // 2, 3, device=device)
    ids[..., 1] = torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(w // 2, device=device)[None, :]
    return ids.reshape(-1, 3)


class FluxTrainable:
    """The FLUX transformer and the flow-matching loss on cached latents and text embeddings."""

    def __init__(self, transformer: Any, settings: Any, train: Any = None):
        self.model = transformer
        self.text_encoders: dict[str, torch.nn.Module] = {}  # lora.text_encoder: the adapted CLIP-L
        self.settings = settings
        self.train = train  # [train]: the loss type (None: l2)
        self.guidance = settings.guidance if transformer.config.guidance_embeds else None
        self.facts = {"variant": "dev" if transformer.config.guidance_embeds else "schnell"}

    def encode_text(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """CLIP-L's pooled output for the batch's tokens, as FluxFamily.encode_text (differentiable)."""
        return {"pooled_prompt_embeds": self.text_encoders["text_encoder"](batch["input_ids"]).pooler_output}

    def reference_tokens(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Packed tokens and their position ids that condition the prediction without being denoised
        (none for FLUX.1; an edit model's source image)."""
        return None

    def loss(self, batch: dict[str, torch.Tensor], generator: Any) -> torch.Tensor:
        if self.text_encoders:
            batch = {**batch, **self.encode_text(batch)}
        latents = batch["latents"]
        device, (n, _, h, w) = latents.device, latents.shape
        x0, noise, sigma, noisy = noised(self.settings, latents, generator)
        dtype = self.model.dtype
        text = batch["prompt_embeds"]
        tokens, ids = noisy.to(dtype), image_ids(h, w, device)
        reference = self.reference_tokens(batch)
        if reference is not None:  # e.g. FLUX.1 Kontext's source image: more tokens after the noisy ones
            tokens, ids = torch.cat([tokens, reference[0].to(dtype)], 1), torch.cat([ids, reference[1]])
        attention = None
        if "text_mask" in batch:  # [flux] apply_t5_attn_mask: no query attends to T5's padding (kohya's mask)
            attention = {"attention_mask": attention_mask(batch["text_mask"], tokens.shape[1])}
        pred = self.model(
            hidden_states=tokens,
            timestep=sigma.to(dtype),  # the transformer multiplies by 1000 itself
            guidance=None if self.guidance is None else torch.full((n,), self.guidance, device=device, dtype=dtype),
            pooled_projections=batch["pooled_prompt_embeds"].to(dtype),
            encoder_hidden_states=text.to(dtype),
            txt_ids=torch.zeros(text.shape[1], 3, device=device, dtype=dtype),
            img_ids=ids.to(dtype),
            joint_attention_kwargs=attention,
            return_dict=False,
        )[0][:, :x0.shape[1]]  # the prediction for the noisy tokens only
        return flow_matching_loss(self.settings, batch, pred, noise, x0, sigma, self.train)


def attention_mask(text_mask: torch.Tensor, image_tokens: int) -> torch.Tensor:
    """[B, 1, 1, text + image] bool: which keys every query attends to in the joint attention, the
    text's tokens as ``text_mask`` says and every image token (kohya's apply_t5_attn_mask)."""
    ones = torch.ones(text_mask.shape[0], image_tokens, dtype=torch.bool, device=text_mask.device)
    return torch.cat([text_mask.bool(), ones], dim=1)[:, None, None, :]


def masked_sampler(sample: Callable[..., Any], denoiser: torch.nn.Module) -> Callable[..., Any]:
    """With [flux] apply_t5_attn_mask, samples as the model was trained: each prompt's T5 mask (cached
    with its embeddings) masks the padding in every transformer call (a pre-hook, as the pipeline
    gives the transformer no mask of its own; the image tokens counted as each call has them, an
    edit model's source tokens included)."""

    def masked(embeds: dict[str, torch.Tensor], seed: int) -> Any:
        text_mask = embeds["text_mask"][None]

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            hidden = kwargs["hidden_states"]
            mask = attention_mask(text_mask.to(hidden.device).expand(hidden.shape[0], -1), hidden.shape[1])
            return args, {**kwargs, "joint_attention_kwargs": {**(kwargs.get("joint_attention_kwargs") or {}),
                                                               "attention_mask": mask}}

        handle = denoiser.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            return sample(embeds, seed)
        finally:
            handle.remove()

    masked.settings = {**sample.settings, "t5_attention_mask": True}  # type: ignore[attr-defined]
    return masked


def meta_trainable(root: "Path | None", cfg: Any, dtype: torch.dtype, cls: type | None = None) -> "FluxTrainable":
    """The transformer of ``root`` (a model or config folder; None: FLUX.1-dev's shipped config) on
    the meta device, frozen, with the preset's gradient checkpointing: for ``imglora plan``."""
    from diffusers import FluxTransformer2DModel

    from ...models.safefiles import diffusers_config

    config = diffusers_config(FluxTransformer2DModel, root or singlefile.CONFIGS / "flux1-dev", "transformer")
    with torch.device("meta"):
        transformer = torch.nn.Module.to(FluxTransformer2DModel.from_config(config), dtype)  # (no diffusers warning)
    transformer.requires_grad_(False)
    if cfg.memory.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    trainable = (cls or FluxTrainable)(transformer, cfg.family, cfg.train)
    if cfg.lora.text_encoder:
        from .._shared import diffusers_image
        from . import FluxFamily

        trainable.text_encoders = diffusers_image.meta_text_encoders(FluxFamily, root, singlefile.CONFIGS / "flux1-dev",
                                                                     dtype)
    return trainable

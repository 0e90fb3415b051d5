"""Qwen-Image 2.1's trained module, loss and text encoding.

The transformer (``QwenImage21Transformer2DModel``, 7.1B) is one block-causal stream of 32 blocks:
the caption's tokens first (causal among themselves, never reading the image), the image's after
them (reading every caption token and each other). Text rows take their modulation from t = 0, the
image's from the sample's σ, so the caption's rows do not depend on the noise. The caption comes
from Qwen3-VL-8B inside the pipeline's template: the last layer's hidden states *before* the final
RMSNorm (the pipeline neutralises the norm with a hook), the system turn's tokens dropped, each
caption its own length (the pipeline keeps only real tokens and pads a batch on the right with a
mask). Pixels are RGBA (an opaque training image gets alpha 1); the VAE (64 channels, 1/16) gives
``(z − mean) / std`` per channel, one token per latent pixel. The loss is flow matching as the
pipeline steps: ``x_σ = (1 − σ) x0 + σ ε`` against ``ε − x0``, the transformer given σ, its output
over the whole joint sequence of which the last ``h·w`` rows are the image's; timesteps shifted by
e^mu with mu linear in the token count (the pipeline's schedule: 0.5 at 256 tokens, 0.9 at 8192).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...errors import ImgloraError
from ...models.tiny import random_init
from ...util.rng import draws
from .._shared import one_stream, stream
from .._shared.flow_matching import flow_matching_loss, sample_sigmas

if TYPE_CHECKING:
    from ...memory.swap import SwapLayout
    from ...models.source import ModelSource

CONFIGS = Path(__file__).parent / "configs" / "qwen-image-2.1"
MODEL_CLASS = "QwenImage21Transformer2DModel"
BLOCKS = {"block": "transformer_blocks"}
# QwenImage21Pipeline's text-to-image template; the system turn's tokens are dropped from the states.
SYSTEM = "Comprehend and analyze the provided prompt."
SYSTEM_TURN = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
PREFIX = SYSTEM_TURN + "<|im_start|>user\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
# The pipeline has no limit; imglora cuts a caption so that at most this many states are kept.
TEXT_MAX_LENGTH = 1024
PLAN_TEXT_TOKENS = 256
TOKENS_PER_SLOT = 4  # each of the transformer's image slots stands for 2×2 latent tokens


def block_counts(root: Path) -> list[int]:
    return [one_stream.block_count(root, 32)]


def shift_mu(root: Path | None) -> Callable[[int], float]:
    """The pipeline's shift: mu linear in the image's token count, from the model's scheduler config."""
    return one_stream.scheduler_shift(root, CONFIGS)


def load_trainable(src: "ModelSource", cfg: Any, device: torch.device, dtype: torch.dtype, layout: "SwapLayout",
                   quantize_exclude: tuple[str, ...]) -> "QwenImage21Trainable":
    """Read block by block (``_shared.stream``): each block quantized with memory.fp8 and placed as it is
    read (from a diffusers folder, or from ComfyUI's single file: ``singlefile.load_transformer``)."""
    from functools import partial

    from . import singlefile

    transformer, facts = stream.load_transformer(src, cfg, dtype, device, layout, quantize_exclude,
                                                 model_class=MODEL_CLASS,
                                                 file_reader=partial(singlefile.load_transformer, blocks=BLOCKS),
                                                 blocks=BLOCKS)
    trainable = _trainable(transformer, cfg, src.root)
    trainable.facts.update(facts)
    return trainable


def full_trainable(cfg: Any, dtype: torch.dtype, layout: "SwapLayout", device: torch.device | None = None,
                   family: Any = None) -> "QwenImage21Trainable":
    from .._shared.diffusers_image import builds_on_device, random_on_device

    transformer = _meta(CONFIGS, dtype)
    facts: dict[str, Any] = {}
    if builds_on_device(device):
        parts = [f"transformer_blocks.{i}" for i in range(len(transformer.transformer_blocks))]
        transformer, facts = random_on_device(family, transformer, cfg, dtype, device, parts, layout)
    else:
        transformer = random_init(transformer, dtype)
    trainable = _trainable(transformer, cfg, None)
    if facts:
        trainable.facts["full_build"] = facts
    return trainable


def meta_trainable(root: Path | None, cfg: Any, dtype: torch.dtype) -> "QwenImage21Trainable":
    return _trainable(_meta(root or CONFIGS, dtype).requires_grad_(False), cfg, root)


def _meta(root: Path, dtype: torch.dtype) -> Any:
    from diffusers import QwenImage21Transformer2DModel

    from ...models.safefiles import diffusers_config

    config = diffusers_config(QwenImage21Transformer2DModel, root, "transformer")
    with torch.device("meta"):
        return torch.nn.Module.to(QwenImage21Transformer2DModel.from_config(config), dtype)


def restore_buffers(transformer: Any) -> Any:
    """The timestep embedding's frequencies and the rotary tables, made anew (float32, complex64) as
    the model's constructor makes them: tensors not saved with the weights, so a model built on the
    meta device and then filled (block by block, or with random weights) has none until this."""
    proj, rope = transformer.time_text_embed.time_proj, transformer.pos_embed
    device = transformer.img_in.weight.device
    transformer.time_text_embed.time_proj = type(proj)(proj.timestep_dim, time_factor=proj.time_factor).to(device)
    with torch.device("cpu"):
        transformer.pos_embed = type(rope)(theta=rope.theta, axes_dim=list(rope.axes_dim))
    return transformer


def _trainable(transformer: Any, cfg: Any, root: Path | None) -> "QwenImage21Trainable":
    restore_buffers(transformer)
    if cfg.memory.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    return QwenImage21Trainable(transformer, cfg.family, cfg.train, shift_mu(root))


def synthetic_batch(trainable: "QwenImage21Trainable", resolution: int, cfg: Any,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """Random tensors shaped like one cached sample (a caption of the plan's length)."""
    c = trainable.model.config
    n, r = cfg.train.batch_size, resolution // 32 * 32
    length = min(cfg.cache.text_max_length or TEXT_MAX_LENGTH, PLAN_TEXT_TOKENS)
    g = torch.Generator().manual_seed(0)
    return {k: v.to(device) for k, v in {
        "latents": torch.randn(n, c.in_channels, r // 16, r // 16, generator=g),
        "prompt_embeds": torch.randn(n, length, c.context_in_dim, generator=g),
    }.items()}


collate = one_stream.collate_captions  # (the pipeline's layout for a batch of prompts)


def system_tokens(tokenizer: Any) -> int:
    """How many leading states the pipeline drops: the system turn's tokens (its ``_drop_idx``)."""
    return len(tokenizer(SYSTEM_TURN).input_ids)


def language_model(encoder: Any) -> Any:
    """The decoder whose final norm the pipeline bypasses (Qwen3VLModel's, or the generation model's)."""
    inner = getattr(encoder, "model", encoder)
    return getattr(inner, "language_model", inner)


def encode_caption(tokenizer: Any, encoder: Any, caption: str, max_length: int) -> torch.Tensor:
    """[L, hidden]: the caption's states as QwenImage21Pipeline encodes one prompt: the template, the
    last layer's output before the final norm, the system turn dropped; the caption cut so that at
    most ``max_length`` states are kept (the user turn and the assistant's opening count)."""
    drop = system_tokens(tokenizer)
    suffix = tokenizer(SUFFIX, return_tensors="pt").input_ids
    text = tokenizer(PREFIX + (caption or " "), truncation=True, max_length=max_length + drop - suffix.shape[1],
                     return_tensors="pt").input_ids
    ids = torch.cat([text, suffix], dim=1).to(encoder.device)
    handle = language_model(encoder).norm.register_forward_hook(lambda module, args, output: args[0])
    try:
        out = encoder(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    return out.hidden_states[-1][0][drop:]


def normalize_latents(latents: torch.Tensor, vae_config: Any) -> torch.Tensor:
    """[B, 64, 1, h, w] VAE means → [B, 64, h, w]: ``(z − mean) / std`` per channel (the pipeline's
    _encode_vae_image; it decodes with the inverse)."""
    mean = torch.tensor(vae_config.latents_mean).view(1, -1, 1, 1, 1).to(latents)
    std = torch.tensor(vae_config.latents_std).view(1, -1, 1, 1, 1).to(latents)
    return ((latents - mean) / std)[:, :, 0]


def rgba(pixels: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] in [-1, 1] → [B, 4, 1, H, W]: an opaque image as the VAE reads it (alpha = 1,
    what the pipeline's ``convert("RGBA")`` and its ``2x − 1`` give)."""
    return torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)[:, :, None]


def tokens(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] → [B, h·w, C]: one token per latent pixel, row by row (the pipeline's _pack_latents)."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).transpose(1, 2)


def layout(n: int, text_len: int, h: int, w: int, device: torch.device) -> dict[str, Any]:
    """The transformer's layout arguments for text-to-image: the target's shape in latent tokens and
    the joint sequence's mask of image slots (the caption's, then one slot per 2×2 latent tokens)."""
    if h % 2 or w % 2:  # (the pipeline's sizes: each image slot is 2×2 latent tokens)
        raise ImgloraError(f"Qwen-Image 2.1 needs images whose sides are multiples of 32 pixels; got latents of "
                           f"{h}×{w} (set data.bucket_step or the resolution to a multiple of 32)")
    img_mask = torch.cat([torch.zeros(n, text_len, dtype=torch.bool),
                          torch.ones(n, h * w // TOKENS_PER_SLOT, dtype=torch.bool)], dim=1)
    if device.type != "meta":  # (the plan's run on the meta device: the model reads the layout from its values)
        img_mask = img_mask.to(device)
    return {"img_shapes": [[(1, h, w)]] * n, "img_mask": img_mask}


class QwenImage21Trainable:
    """The Qwen-Image 2.1 transformer and the flow-matching loss on cached latents and caption states."""

    def __init__(self, transformer: Any, settings: Any, train: Any = None, mu: Callable[[int], float] | None = None):
        self.model = transformer
        self.settings = settings
        self.train = train  # [train]: the loss type (None: l2)
        self.shift_mu = mu or shift_mu(None)
        self.facts: dict[str, Any] = {"variant": "qwen-image-2.1"}

    def loss(self, batch: dict[str, torch.Tensor], generator: Any) -> torch.Tensor:
        latents = batch["latents"]
        n, _, h, w = latents.shape
        x0 = tokens(latents)
        noise = draws(generator).randn(x0.shape, device=latents.device, dtype=x0.dtype)
        sigma = sample_sigmas(n, self.settings, h * w, generator, latents.device, self.shift_mu)
        s = sigma.view(n, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        dtype = self.model.dtype
        embeds = batch["prompt_embeds"].to(dtype)
        out = self.model(hidden_states=noisy.to(dtype), encoder_hidden_states=embeds, timestep=sigma.to(dtype),
                         encoder_hidden_states_mask=batch.get("prompt_mask"),
                         **layout(n, embeds.shape[1], h, w, latents.device), return_dict=False)[0]
        return flow_matching_loss(self.settings, batch, out[:, -h * w:], noise, x0, sigma, self.train, layout=tokens)


def tokenizer_folder(root: Path) -> Path:
    """Where the model's tokenizer is: Qwen/Qwen-Image-2.1 keeps it in the processor's folder."""
    return next((root / name for name in ("tokenizer", "processor") if (root / name).is_dir()), root / "processor")


def load_processor(root: Path, tokenizer: Any = None) -> Any:
    """The pipeline's ``Qwen3VLProcessor`` (its chat template, tokenizing and image-token expansion)
    over the folder's image processor without its video processor: transformers builds that one
    only with torchvision, which nothing else here needs, and videos are never passed."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor

    folder = tokenizer_folder(root)

    class ImageTextProcessor(Qwen3VLProcessor):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                     **kwargs: Any):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(folder)
    template = folder / "chat_template.json"
    chat = json.loads(template.read_text())["chat_template"] if template.is_file() else None
    return ImageTextProcessor(AutoImageProcessor.from_pretrained(folder), tokenizer, chat_template=chat)

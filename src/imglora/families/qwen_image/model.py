"""Qwen-Image's trained module and loss: flow matching on packed 2×2 latent patches (the same
packing and target ``noise - x0`` as FLUX.1), conditioned on Qwen2.5-VL's last hidden states of the
caption inside the pipeline's chat template (the template's 34 leading tokens dropped, as
QwenImagePipeline does), with the image's shape for the transformer's rotary positions and no
guidance embedding. Timesteps are drawn with the model's own resolution-dependent shift (its
scheduler's dynamic shift) by default.

Captions have their own lengths (the pipeline pads nothing for one prompt): the cache keeps each
caption's embeddings unpadded, and a batch of captions of different lengths is padded with a mask
(``collate``), which the transformer applies in attention. A batch of equal lengths carries no
mask, so batch size 1 runs the unmasked attention kernels, as the pipeline does."""

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

CONFIGS = Path(__file__).parent / "configs" / "qwen-image"
BLOCKS = {"block": "transformer_blocks"}  # its one block list, for the streamed reader
MODEL_CLASS = "QwenImageTransformer2DModel"
# QwenImagePipeline's prompt_template_encode and prompt_template_encode_start_idx: the caption goes
# into a chat template, and the hidden states of the template's first 34 tokens (the system prompt
# and "<|im_start|>user\n") are dropped; the caption's and the 5 closing tokens' are kept.
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")
TEMPLATE_TOKENS = 34
TEXT_MAX_LENGTH = 1024  # the pipeline's tokenizer_max_length: caption tokens kept after the template's
PLAN_TEXT_TOKENS = 256  # a long caption's tokens (and the closing ones), for planning and benchmarks


def block_counts(root: Path) -> list[int]:
    return [one_stream.block_count(root, 60)]


def shift_mu(root: Path | None) -> Callable[[int], float]:
    """The scheduler's dynamic shift as QwenImagePipeline computes it (``calculate_shift``), read from
    the model's scheduler config (the shipped one if it has none)."""
    return one_stream.scheduler_shift(root, CONFIGS)


def load_trainable(src: "ModelSource", cfg: Any, device: torch.device, dtype: torch.dtype, layout: "SwapLayout",
                   quantize_exclude: tuple[str, ...], make: Any = None) -> "QwenImageTrainable":
    """Read block by block (``_shared.stream``): each block quantized with memory.fp8 and placed as it
    is read, so the host never holds the 20B transformer in its load dtype; the quantized model
    kept in the cache for the next run."""
    from . import singlefile

    transformer, facts = stream.load_transformer(src, cfg, dtype, device, layout, quantize_exclude,
                                                 model_class=MODEL_CLASS, file_reader=singlefile.load_transformer,
                                                 blocks=BLOCKS)
    trainable = _trainable(with_rope_tables(transformer), cfg, src.root, make)
    trainable.facts.update(facts)
    return trainable


def full_trainable(cfg: Any, dtype: torch.dtype, layout: "SwapLayout", device: torch.device | None = None, family: Any = None,
                   make: Any = None) -> "QwenImageTrainable":
    """The real Qwen-Image transformer architecture (20B) with random weights, for benchmarks (made
    block by block on CUDA: ``diffusers_image.random_on_device``)."""
    from .._shared.diffusers_image import builds_on_device, random_on_device

    transformer = _meta(CONFIGS, dtype)
    facts: dict[str, Any] = {}
    if builds_on_device(device):
        parts = [f"transformer_blocks.{i}" for i in range(len(transformer.transformer_blocks))]
        transformer, facts = random_on_device(family, transformer, cfg, dtype, device, parts, layout)
    else:
        transformer = random_init(transformer, dtype)
    trainable = _trainable(with_rope_tables(transformer), cfg, None, make)
    if facts:
        trainable.facts["full_build"] = facts
    return trainable


def meta_trainable(root: "Path | None", cfg: Any, dtype: torch.dtype, make: Any = None) -> "QwenImageTrainable":
    """The transformer of ``root`` (None: Qwen-Image's shipped config) on the meta device, frozen."""
    return _trainable(_meta(root or CONFIGS, dtype).requires_grad_(False), cfg, root, make)


def with_rope_tables(transformer: Any) -> Any:
    """The rotary position tables (``pos_embed.pos_freqs`` / ``neg_freqs``: complex tensors that
    diffusers keeps as plain attributes, neither saved nor buffers) made again for a model built on
    the meta device, where they were made on meta too. On the host, as ``from_pretrained`` leaves
    them (the module copies them to the device it runs on, once)."""
    pe = transformer.pos_embed
    with torch.device("cpu"):
        transformer.pos_embed = type(pe)(theta=pe.theta, axes_dim=list(pe.axes_dim), scale_rope=pe.scale_rope)
    return transformer


def _meta(root: Path, dtype: torch.dtype) -> Any:
    from diffusers import QwenImageTransformer2DModel

    from ...models.safefiles import diffusers_config

    config = diffusers_config(QwenImageTransformer2DModel, root, "transformer")
    with torch.device("meta"):
        return torch.nn.Module.to(QwenImageTransformer2DModel.from_config(config), dtype)


def _trainable(transformer: Any, cfg: Any, root: Path | None, make: Any = None) -> "QwenImageTrainable":
    """``make(transformer, settings, train, mu)``: the trainable's class (a family built on Qwen-Image's
    transformer gives its own; default QwenImageTrainable)."""
    if cfg.memory.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    return (make or QwenImageTrainable)(transformer, cfg.family, cfg.train, shift_mu(root))


def synthetic_batch(trainable: "QwenImageTrainable", resolution: int, cfg: Any,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """Random tensors shaped like one cached sample (a long caption: PLAN_TEXT_TOKENS, or the cache's
    token length when it is shorter)."""
    c = trainable.model.config
    n, r = cfg.train.batch_size, resolution
    length = min(cfg.cache.text_max_length or TEXT_MAX_LENGTH, PLAN_TEXT_TOKENS)
    g = torch.Generator().manual_seed(0)
    return {k: v.to(device) for k, v in {
        "latents": torch.randn(n, c.in_channels // 4, r // 8, r // 8, generator=g),
        "prompt_embeds": torch.randn(n, length, c.joint_attention_dim, generator=g),
    }.items()}


def unused_outputs(transformer: Any) -> list[str]:
    """Module names of the last block's layers whose outputs reach only its text stream, which the
    transformer never reads after that block: the text queries (``add_q_proj``: the text tokens'
    attention outputs; the text keys and values still reach the image tokens), the text attention's
    output projection and the text MLP. ComfyUI's loader reported these weights unchanged in every
    export that adapted them."""
    last = f"transformer_blocks.{len(transformer.transformer_blocks) - 1}"
    return [f"{last}.attn.add_q_proj", f"{last}.attn.to_add_out", f"{last}.txt_mlp.net.0.proj",
            f"{last}.txt_mlp.net.2"]


collate = one_stream.collate_captions  # (as the pipeline pads a batch of prompts)


def encode_caption(tokenizer: Any, encoder: Any, caption: str, max_length: int) -> torch.Tensor:
    """[L, D]: the caption's hidden states as QwenImagePipeline._get_qwen_prompt_embeds computes them
    for one prompt: the templated text tokenized (cut at ``max_length`` + the template's tokens),
    Qwen2.5-VL's last hidden states, the template's first tokens dropped."""
    t = tokenizer(TEMPLATE.format(caption), max_length=max_length + TEMPLATE_TOKENS, truncation=True,
                  return_tensors="pt")
    out = encoder(input_ids=t.input_ids.to(encoder.device), attention_mask=t.attention_mask.to(encoder.device),
                  output_hidden_states=True)
    return out.hidden_states[-1][0, TEMPLATE_TOKENS:]


class QwenImageTrainable:
    """The Qwen-Image transformer and the flow-matching loss on cached latents and text states."""

    def __init__(self, transformer: Any, settings: Any, train: Any = None,
                 mu: Callable[[int], float] | None = None):
        self.model = transformer
        self.settings = settings
        self.train = train  # [train]: the loss type (None: l2)
        self.shift_mu = mu or shift_mu(None)
        self.facts: dict[str, Any] = {"variant": "qwen-image"}

    def loss(self, batch: dict[str, torch.Tensor], generator: Any) -> torch.Tensor:
        latents = batch["latents"]
        n, _, h, w = latents.shape
        x0, noise, sigma, noisy = noised(self.settings, latents, generator, self.shift_mu)
        references, shapes = self.reference_tokens(batch)
        dtype = self.model.dtype
        pred = self.model(
            hidden_states=torch.cat([noisy, *references], dim=1).to(dtype),
            encoder_hidden_states=batch["prompt_embeds"].to(dtype),
            encoder_hidden_states_mask=batch.get("prompt_mask"),
            timestep=sigma.to(dtype),  # the transformer multiplies by 1000 itself
            # per sample, (frames, rows, columns) of each image's tokens: the noisy image's, then the references'
            img_shapes=[[(1, h // 2, w // 2), *shapes]] * n,
            return_dict=False,
        )[0]
        return flow_matching_loss(self.settings, batch, pred[:, :noisy.shape[1]], noise, x0, sigma, self.train)

    def reference_tokens(self, batch: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple[int, ...]]]:
        """Clean image tokens appended after the noisy ones (the edit models' source images) and their
        (frames, rows, columns); Qwen-Image itself has none."""
        return [], []


def normalize_std(std: torch.Tensor, vae_config: Any) -> torch.Tensor:
    """The posterior's standard deviation [B, C, 1, h, w] in the units of :func:`normalize_latents`."""
    inv_std = (1.0 / torch.tensor(vae_config.latents_std)).view(1, -1, 1, 1, 1).to(std)
    return (std * inv_std)[:, :, 0]


def normalize_latents(latents: torch.Tensor, vae_config: Any) -> torch.Tensor:
    """[B, C, 1, h, w] VAE means → [B, C, h, w] as the transformer sees them: ``(x - mean) * (1 / std)``
    per channel, as diffusers' Qwen-Image training script computes it (QwenImagePipeline decodes
    with the inverse, ``x / (1 / std) + mean``)."""
    mean = torch.tensor(vae_config.latents_mean).view(1, -1, 1, 1, 1).to(latents)
    inv_std = (1.0 / torch.tensor(vae_config.latents_std)).view(1, -1, 1, 1, 1).to(latents)
    return ((latents - mean) * inv_std)[:, :, 0]



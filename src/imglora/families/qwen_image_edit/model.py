"""Qwen-Image-Edit's text encoding and loss, as ``QwenImageEditPipeline`` and
``QwenImageEditPlusPipeline`` compute them.

Text: Qwen2.5-VL reads the caption *and the source image(s)*: the Edit chat template (64 tokens
before the user's turn, dropped from the hidden states as the pipelines drop them), the source
image's vision tokens inside it. Edit puts one image into the user's turn, seen at about 1024²
(``calculate_dimensions(1024², ratio)``); Edit Plus (2509, 2511) puts ``Picture i: <image>`` before
the caption for each source, each seen at about 384². The pipelines cut nothing; imglora cuts the
caption's own tokens at ``cache.text_max_length`` (1024 by default, so as the pipelines).

Loss: Qwen-Image's flow matching; each source's latent tokens (its latents at the target's bucket,
packed 2×2, clean) appended after the noisy ones, ``img_shapes`` listing the target and each source,
the prediction read for the noisy tokens only.
"""

from __future__ import annotations

from typing import Any

import torch

from .._shared.flow_matching import pack_latents
from ..qwen_image.model import TEXT_MAX_LENGTH, QwenImageTrainable
from ..qwen_image.model import synthetic_batch as qwen_batch

# QwenImageEditPipeline.prompt_template_encode (Edit); Edit Plus has the same system prompt and no
# image in the template (its images come with "Picture i: " before the caption).
SYSTEM = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
          "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
          "image that meets the user's requirements while maintaining consistency with the original input where "
          "appropriate.<|im_end|>\n<|im_start|>user\n")
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
TEMPLATE = SYSTEM + VISION + "{}<|im_end|>\n<|im_start|>assistant\n"
TEMPLATE_PLUS = SYSTEM + "{}<|im_end|>\n<|im_start|>assistant\n"
PICTURE = "Picture {}: " + VISION  # Edit Plus, before the caption, per source image
TEMPLATE_TOKENS = 64  # prompt_template_encode_start_idx: the system turn and "<|im_start|>user\n"
# The words of the Edit template, so the tiny tokenizer cuts it as the real one does (64 tokens before
# the user's text; "(", ")," and "'s" are single tokens there too).
TEMPLATE_WORDS = ("Describe", "key", "features", "input", "color", "shape", "size", "texture", "objects",
                  "background", "then", "explain", "how", "user", "'s", "text", "instruction", "should", "alter",
                  "or", "modify", "image", "Generate", "new", "meets", "requirements", "while", "maintaining",
                  "consistency", "original", "where", "appropriate", "(", "),", "Picture", "system", "assistant")
EDIT_AREA = 1024 * 1024  # Edit: the source as the text encoder sees it (QwenImageEditPipeline)
PLUS_AREA = 384 * 384  # Edit Plus: CONDITION_IMAGE_SIZE
PLUS_SOURCES = 3  # Edit Plus takes up to three sources (as Qwen's model card and ComfyUI's node)


def load_processor(folder: Any, tokenizer: Any) -> Any:
    """The pipelines' ``Qwen2VLProcessor`` (its own tokenizing and image-token expansion) over the
    image processor of ``folder``, without its video processor: transformers builds that one only
    with torchvision, which nothing else here needs, and videos are never passed."""
    from transformers import AutoImageProcessor, Qwen2VLProcessor

    class ImageTextProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                     **kwargs: Any):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return ImageTextProcessor(AutoImageProcessor.from_pretrained(folder), tokenizer)


def calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    """(width, height) of about ``area`` pixels at ``ratio`` = width / height, multiples of 32
    (the pipelines' ``calculate_dimensions``)."""
    width = (area * ratio) ** 0.5
    return round(width / 32) * 32, round(width / ratio / 32) * 32


def vision_view(image: Any, area: int) -> Any:
    """The source as Qwen2.5-VL sees it: resized (Lanczos, as the pipelines' VaeImageProcessor) to
    about ``area`` pixels at its aspect ratio."""
    from diffusers.image_processor import VaeImageProcessor

    width, height = calculate_dimensions(area, image.width / image.height)
    return VaeImageProcessor(vae_scale_factor=16).resize(image.convert("RGB"), height, width)


def cut_caption(tokenizer: Any, caption: str, max_length: int) -> tuple[str, int]:
    """The caption cut to its first ``max_length`` tokens (the image tokens around it are never cut),
    and how many tokens it had."""
    ids = tokenizer(caption, add_special_tokens=False).input_ids
    return (tokenizer.decode(ids[:max_length]) if len(ids) > max_length else caption), len(ids)


def encode_caption(processor: Any, encoder: Any, caption: str, images: list[Any], plus: bool,
                   max_length: int = TEXT_MAX_LENGTH) -> torch.Tensor:
    """[L, D]: the hidden states of the caption with its source image(s), as the pipeline's
    ``_get_qwen_prompt_embeds(prompt, image)`` computes them for one prompt (``images`` already as
    the text encoder sees them: :func:`vision_view`)."""
    caption, _ = cut_caption(processor.tokenizer, caption, max_length)
    if plus:
        text = TEMPLATE_PLUS.format("".join(PICTURE.format(i + 1) for i in range(len(images))) + caption)
    else:
        text = TEMPLATE.format(caption)
    inputs = processor(text=[text], images=images, padding=True, return_tensors="pt").to(encoder.device)
    out = encoder(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                  pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                  output_hidden_states=True)
    return out.hidden_states[-1][0, TEMPLATE_TOKENS:]


class QwenImageEditTrainable(QwenImageTrainable):
    """Qwen-Image's loss with the source images' clean latent tokens appended (``control_latents``:
    [n, k, C, h, w], each source at the target's bucket)."""

    def __init__(self, transformer: Any, settings: Any, train: Any = None, mu: Any = None, variant: str = "edit"):
        super().__init__(transformer, settings, train, mu)
        self.facts = {"variant": variant}

    def reference_tokens(self, batch: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple[int, ...]]]:
        controls = batch["control_latents"]
        _, k, _, h, w = controls.shape
        return [pack_latents(controls[:, i]) for i in range(k)], [(1, h // 2, w // 2)] * k


def synthetic_batch(trainable: Any, resolution: int, cfg: Any, device: torch.device,
                    sources: int, vision_tokens: int) -> dict[str, torch.Tensor]:
    """Qwen-Image's synthetic batch with ``sources`` source images of the target's size and the text
    states of a long caption with their vision tokens (for planning and benchmarks)."""
    batch = qwen_batch(trainable, resolution, cfg, device)
    g = torch.Generator().manual_seed(1)
    text = batch["prompt_embeds"]
    n, length, dim = text.shape
    batch["prompt_embeds"] = torch.randn(n, length + sources * vision_tokens, dim,
                                         generator=g).to(device)
    batch["control_latents"] = torch.randn(n, sources, *batch["latents"].shape[1:], generator=g).to(device)
    return batch


def vision_tokens(area: int, patch: int = 14, merge: int = 2) -> int:
    """The vision tokens of a square source of ``area`` pixels (Qwen2.5-VL: 14-pixel patches, 2×2
    merged), plus its two markers: for planning."""
    side = round(area ** 0.5 / (patch * merge))
    return side * side + 2

"""The tiny Qwen-Image model (``tiny:qwen_image``): the real layout (a Qwen2.5-VL text encoder with
its vision tower, a Qwen2 tokenizer, Qwen-Image's 3D-causal VAE and transformer, the real scheduler
config), tiny widths, random weights (see ``imglora.models.tiny``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from ...models.tiny import save_model, seeded
from .._shared import tiny_parts as tp
from .model import CONFIGS

# The words of QwenImagePipeline's chat template, so it tokenizes as the real tokenizer cuts it
# (34 tokens before the caption, 5 after).
TEMPLATE_WORDS = ("system", "user", "assistant", "Describe", "image", "by", "detailing", "color", "shape", "size",
                  "texture", "quantity", "text", "spatial", "relationships", "objects")


def build(dest: Path, seed: int, pipeline: str = "QwenImagePipeline", processor: Path | None = None,
          words: tuple[str, ...] = ()) -> None:
    """``processor``: a folder with an image processor's config (the Edit models): written as the real
    repositories' ``processor/`` (the tokenizer's files beside it); ``words``: more template words."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab = tp.write_qwen2_tokenizer(dest / "tokenizer", tuple(dict.fromkeys((*TEMPLATE_WORDS, *words))))
    special = {t: vocab - len(tp.QWEN2_SPECIAL) + i for i, t in enumerate(tp.QWEN2_SPECIAL)}
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, tie_word_embeddings=False,
                         bos_token_id=special["<|endoftext|>"], eos_token_id=special["<|im_end|>"]),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0]),
        image_token_id=special["<|image_pad|>"], video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"], vision_end_token_id=special["<|vision_end|>"],
        bos_token_id=special["<|endoftext|>"], eos_token_id=special["<|im_end|>"])
    save_model(seeded(seed, "text_encoder", lambda: Qwen2_5_VLForConditionalGeneration(config)), dest / "text_encoder")
    # The 3D-causal VAE in the real model's layout (its levels, blocks and 8× downsampling: the layout
    # ComfyUI's Wan 2.1 file has), tiny widths; the real latent statistics (its config's defaults).
    save_model(seeded(seed, "vae", lambda: AutoencoderKLQwenImage(base_dim=4, z_dim=16, dim_mult=[1, 2, 4, 4],
                                                                   num_res_blocks=2)), dest / "vae")
    save_model(seeded(seed, "transformer", lambda: QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=3, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=config.text_config.hidden_size, axes_dims_rope=(4, 6, 6))), dest / "transformer")
    shutil.copytree(CONFIGS / "scheduler", dest / "scheduler")  # the real model's scheduler
    extra = {}
    if processor is not None:
        shutil.copytree(dest / "tokenizer", dest / "processor")
        shutil.copy(processor / "preprocessor_config.json", dest / "processor" / "preprocessor_config.json")
        extra["processor"] = ("transformers", "Qwen2VLProcessor")
    tp.write_model_index(dest, pipeline, {
        **extra,
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
        "tokenizer": ("transformers", "Qwen2Tokenizer"),
        "transformer": ("diffusers", "QwenImageTransformer2DModel"),
        "vae": ("diffusers", "AutoencoderKLQwenImage"),
    })

"""The tiny Krea 2 model (``tiny:krea2``): the real layout (a Qwen3-VL model with the 36 layers whose
states the pipeline taps, a Qwen2 tokenizer that cuts Qwen-Image's template where the real one does,
Qwen-Image's VAE, the transformer with its text fusion and single-stream blocks, the real scheduler
config), tiny widths, random weights (see ``imglora.models.tiny``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from ...models.tiny import save_model, seeded
from .._shared import tiny_parts as tp
from .model import CONFIGS, LAYERS

# The words of the template (Qwen-Image's), so it tokenizes as the real tokenizer cuts it (34 before the
# prompt, 5 after it).
TEMPLATE_WORDS = ("system", "user", "assistant", "Describe", "image", "by", "detailing", "color", "shape", "size",
                  "texture", "quantity", "text", "spatial", "relationships", "objects")


def build(dest: Path, seed: int) -> None:
    from diffusers import AutoencoderKLQwenImage, Krea2Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLModel

    vocab = tp.write_qwen2_tokenizer(dest / "tokenizer", TEMPLATE_WORDS)
    special = {t: vocab - len(tp.QWEN2_SPECIAL) + i for i, t in enumerate(tp.QWEN2_SPECIAL)}
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=36,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048,
                         rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True},
                         bos_token_id=special["<|endoftext|>"], eos_token_id=special["<|im_end|>"]),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                           deepstack_visual_indexes=[0]),
        image_token_id=special["<|image_pad|>"], video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"], vision_end_token_id=special["<|vision_end|>"])
    save_model(seeded(seed, "text_encoder", lambda: Qwen3VLModel(config)), dest / "text_encoder")
    save_model(seeded(seed, "vae", lambda: AutoencoderKLQwenImage(base_dim=4, z_dim=16, dim_mult=[1, 2, 4, 4],
                                                                   num_res_blocks=2)), dest / "vae")
    # head dim 16 = the rotary axes' 4 + 6 + 6, as the real 128 = 32 + 48 + 48
    save_model(seeded(seed, "transformer", lambda: Krea2Transformer2DModel(
        in_channels=64, num_layers=3, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, text_hidden_dim=16, num_text_layers=len(LAYERS), text_num_attention_heads=2,
        text_num_key_value_heads=2, text_intermediate_size=32, num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
        axes_dims_rope=(4, 6, 6))), dest / "transformer")
    shutil.copytree(CONFIGS / "scheduler", dest / "scheduler")  # the real model's scheduler
    tp.write_model_index(dest, "Krea2Pipeline", {
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_encoder": ("transformers", "Qwen3VLModel"),
        "tokenizer": ("transformers", "Qwen2Tokenizer"),
        "transformer": ("diffusers", "Krea2Transformer2DModel"),
        "vae": ("diffusers", "AutoencoderKLQwenImage"),
    }, is_distilled=False, patch_size=2, text_encoder_select_layers=list(LAYERS))

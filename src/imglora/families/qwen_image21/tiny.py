"""The tiny Qwen-Image 2.1 model (``tiny:qwen_image21``): the real layout (a Qwen3-VL generation model
as the pipeline loads it, the processor folder with a Qwen2 tokenizer that cuts the template's system
turn where the real one does, the RGBA 64-channel VAE at 1/16, the block-causal transformer, the real
scheduler config), tiny widths, random weights (see ``imglora.models.tiny``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ...models.tiny import save_model, seeded
from .._shared import tiny_parts as tp
from .model import CONFIGS

# The template's words, so the system turn tokenizes in the real tokenizer's 14 pieces
# ("Comprehend" is three there: Com|pre|hend).
TEMPLATE_WORDS = ("system", "user", "assistant", "Com", "pre", "hend", "and", "analyze", "the", "provided", "prompt")
# Qwen3-VL's chat template for text turns (the processor's; the pipeline renders only the system turn with it).
CHAT_TEMPLATE = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}{%- if m['content'] is string %}"
                 "{{- m['content'] }}{%- else %}{%- for c in m['content'] %}{%- if c['type'] == 'text' %}"
                 "{{- c['text'] }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
                 "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def build(dest: Path, seed: int) -> None:
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    vocab = tp.write_qwen2_tokenizer(dest / "processor", TEMPLATE_WORDS)
    (dest / "processor" / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    Qwen2VLImageProcessorPil().save_pretrained(dest / "processor")
    special = {t: vocab - len(tp.QWEN2_SPECIAL) + i for i, t in enumerate(tp.QWEN2_SPECIAL)}
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048,
                         rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True},
                         bos_token_id=special["<|endoftext|>"], eos_token_id=special["<|im_end|>"]),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                           deepstack_visual_indexes=[0]),
        image_token_id=special["<|image_pad|>"], video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"], vision_end_token_id=special["<|vision_end|>"])
    save_model(seeded(seed, "text_encoder", lambda: Qwen3VLForConditionalGeneration(config)), dest / "text_encoder")
    save_model(seeded(seed, "vae", lambda: AutoencoderKLQwenImage21(base_dim=4, decoder_base_dim=4, z_dim=64,
                                                                     dim_mult=[1, 1, 2, 2, 2], num_res_blocks=1)),
               dest / "vae")
    # head dim 16 = the rotary axes' 4 + 6 + 6, as the real 128 = 16 + 56 + 56
    save_model(seeded(seed, "transformer", lambda: QwenImage21Transformer2DModel(
        num_layers=3, attention_head_dim=16, num_attention_heads=2, context_in_dim=16, mlp_ratio=3,
        axes_dims_rope=(4, 6, 6))), dest / "transformer")
    shutil.copytree(CONFIGS / "scheduler", dest / "scheduler")  # the real model's scheduler
    tp.write_model_index(dest, "QwenImage21Pipeline", {
        "processor": ("transformers", "Qwen3VLProcessor"),
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"),
        "transformer": ("diffusers", "QwenImage21Transformer2DModel"),
        "vae": ("diffusers", "AutoencoderKLQwenImage21"),
    })

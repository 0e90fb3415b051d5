"""The tiny Z-Image model (``tiny:z_image``): the real layout (a Qwen3 text encoder, a Qwen2 tokenizer
with Qwen3's chat template, FLUX.1's 16-channel VAE, Z-Image's transformer with its two refiner
lists and its main blocks, the real scheduler config), tiny widths, random weights (see
``imglora.models.tiny``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from ...models.tiny import save_model, seeded
from .._shared import tiny_parts as tp
from .model import CONFIGS

TEMPLATE_WORDS = ("user", "assistant")  # the chat template's words, one token each as in Qwen's vocabulary


def build(dest: Path, seed: int) -> None:
    from diffusers import ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    vocab = tp.write_qwen3_tokenizer(dest / "tokenizer", TEMPLATE_WORDS)
    special = {t: vocab - len(tp.QWEN2_SPECIAL) + i for i, t in enumerate(tp.QWEN2_SPECIAL)}
    text = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
                       bos_token_id=special["<|endoftext|>"], eos_token_id=special["<|im_end|>"],
                       pad_token_id=special["<|endoftext|>"], tie_word_embeddings=True)
    save_model(seeded(seed, "text_encoder", lambda: Qwen3Model(text)), dest / "text_encoder")
    vae = seeded(seed, "vae", lambda: tp.vae(16, scaling_factor=0.3611, shift_factor=0.1159,
                                            use_quant_conv=False, use_post_quant_conv=False))
    save_model(vae, dest / "vae")
    # head dim 32 = the rotary axes' 8 + 12 + 12, as the real 128 = 32 + 48 + 48
    save_model(seeded(seed, "transformer", lambda: ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=64, n_layers=3, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, cap_feat_dim=text.hidden_size, axes_dims=[8, 12, 12], axes_lens=[1536, 512, 512])),
        dest / "transformer")
    shutil.copytree(CONFIGS / "scheduler", dest / "scheduler")  # the real model's scheduler
    tp.write_model_index(dest, "ZImagePipeline", {
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_encoder": ("transformers", "Qwen3Model"),
        "tokenizer": ("transformers", "Qwen2Tokenizer"),
        "transformer": ("diffusers", "ZImageTransformer2DModel"),
        "vae": ("diffusers", "AutoencoderKL"),
    })

"""The tiny FLUX.2 [klein] model (``tiny:flux2``): the real layout (a Qwen3 causal LM with the 28
layers whose 9th, 18th and 27th hidden states the pipeline reads, a Qwen2 tokenizer with Qwen3's
chat template, FLUX.2's VAE with its batch-norm statistics, the transformer with double and single
blocks, the real scheduler config), tiny widths, random weights (see ``imglora.models.tiny``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ...models.tiny import save_model, seeded
from .._shared import tiny_parts as tp
from .model import MODELS

TEMPLATE_WORDS = ("user", "assistant", "think")


def build(dest: Path, seed: int) -> None:
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = tp.write_qwen3_tokenizer(dest / "tokenizer", TEMPLATE_WORDS)
    special = {t: vocab - len(tp.QWEN2_SPECIAL) + i for i, t in enumerate(tp.QWEN2_SPECIAL)}
    text = Qwen3Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=28,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048,
                       bos_token_id=special["<|endoftext|>"], eos_token_id=special["<|im_end|>"],
                       pad_token_id=special["<|endoftext|>"], tie_word_embeddings=True)
    save_model(seeded(seed, "text_encoder", lambda: Qwen3ForCausalLM(text)), dest / "text_encoder")

    def vae() -> AutoencoderKLFlux2:
        v = AutoencoderKLFlux2(block_out_channels=(16, 32, 32, 32), layers_per_block=1, norm_num_groups=8,
                               latent_channels=32)
        with torch.no_grad():  # statistics of a trained VAE's latents, not the initial 0 and 1
            v.bn.running_mean.copy_(torch.randn(128) * 0.2)
            v.bn.running_var.copy_(torch.rand(128) + 0.5)
        return v

    save_model(seeded(seed, "vae", vae), dest / "vae")
    # head dim 16 = the four rotary axes' 4 each, as the real 128 = 4 × 32; the text width is three
    # of the encoder's layers side by side
    save_model(seeded(seed, "transformer", lambda: Flux2Transformer2DModel(
        in_channels=128, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=3 * text.hidden_size, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)),
        dest / "transformer")
    shutil.copytree(MODELS["klein"] / "scheduler", dest / "scheduler")  # the real model's scheduler
    tp.write_model_index(dest, "Flux2KleinPipeline", {
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_encoder": ("transformers", "Qwen3ForCausalLM"),
        "tokenizer": ("transformers", "Qwen2TokenizerFast"),
        "transformer": ("diffusers", "Flux2Transformer2DModel"),
        "vae": ("diffusers", "AutoencoderKLFlux2"),
    }, is_distilled=False)

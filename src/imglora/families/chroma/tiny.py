"""The tiny Chroma model (``tiny:chroma``): the real layout (T5 only, the approximator in place of
FLUX's modulation layers), tiny widths, random weights (see ``imglora.models.tiny``)."""

from __future__ import annotations

from pathlib import Path

from ...models.tiny import save_model, seeded
from .._shared import tiny_parts as tp
from ..flux.tiny import write_vae_and_scheduler


def build(dest: Path, seed: int) -> None:
    from diffusers import ChromaTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    t5_vocab = tp.write_t5_tokenizer(dest / "tokenizer")
    t5 = T5Config(vocab_size=t5_vocab, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2,
                  feed_forward_proj="gated-gelu", tie_word_embeddings=False, is_encoder_decoder=False,
                  use_cache=False)
    save_model(seeded(seed, "text_encoder", lambda: T5EncoderModel(t5)), dest / "text_encoder")
    transformer = seeded(seed, "transformer", lambda: ChromaTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=t5.d_model, axes_dims_rope=(4, 6, 6),
        approximator_num_channels=16, approximator_hidden_dim=32, approximator_layers=2))
    save_model(transformer, dest / "transformer")
    write_vae_and_scheduler(dest, seed)  # FLUX.1's VAE
    tp.write_model_index(dest, "ChromaPipeline", {
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_encoder": ("transformers", "T5EncoderModel"),
        "tokenizer": ("transformers", "T5TokenizerFast"),
        "transformer": ("diffusers", "ChromaTransformer2DModel"),
        "vae": ("diffusers", "AutoencoderKL"),
    })

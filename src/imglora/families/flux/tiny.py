"""The tiny FLUX model (``tiny:flux``): the real layout, tiny widths, random weights (see ``imglora.models.tiny``)."""

from __future__ import annotations

from pathlib import Path

from ...models.tiny import save_model, seeded
from .._shared import tiny_parts as tp


def build(dest: Path, seed: int, pipeline: str = "FluxPipeline") -> None:
    """``pipeline``: the model_index's class (a model on FLUX.1-dev's transformer, e.g. FLUX.1 Kontext)."""
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    clip_vocab = tp.write_clip_tokenizer(dest / "tokenizer", pad_token="<|endoftext|>")
    t5_vocab = tp.write_t5_tokenizer(dest / "tokenizer_2")
    clip = tp.clip_text_config(clip_vocab, hidden_act="quick_gelu")
    # T5 v1.1 style (gated GELU, untied, relative position buckets) like FLUX's T5-XXL encoder.
    t5 = T5Config(vocab_size=t5_vocab, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2,
                  feed_forward_proj="gated-gelu", tie_word_embeddings=False, is_encoder_decoder=False,
                  use_cache=False)
    save_model(seeded(seed, "text_encoder", lambda: CLIPTextModel(clip)), dest / "text_encoder")
    save_model(seeded(seed, "text_encoder_2", lambda: T5EncoderModel(t5)), dest / "text_encoder_2")

    transformer = seeded(seed, "transformer", lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=64,  # 16 latent channels packed 2x2
        num_layers=4, num_single_layers=8, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=t5.d_model, pooled_projection_dim=clip.hidden_size,
        guidance_embeds=True,  # FLUX.1-dev is guidance-distilled
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    ))
    save_model(transformer, dest / "transformer")
    write_vae_and_scheduler(dest, seed)
    tp.write_model_index(dest, pipeline, {
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_encoder": ("transformers", "CLIPTextModel"),
        "text_encoder_2": ("transformers", "T5EncoderModel"),
        "tokenizer": ("transformers", "CLIPTokenizer"),
        "tokenizer_2": ("transformers", "T5TokenizerFast"),
        "transformer": ("diffusers", "FluxTransformer2DModel"),
        "vae": ("diffusers", "AutoencoderKL"),
    })


def write_vae_and_scheduler(dest: Path, seed: int) -> None:
    """FLUX.1's 16-channel VAE (tiny) and its flow-matching scheduler: shared by the models on FLUX.1's
    VAE (FLUX.1 Kontext, Chroma)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    vae = seeded(seed, "vae", lambda: tp.vae(16, scaling_factor=0.3611, shift_factor=0.1159,
                                            use_quant_conv=False, use_post_quant_conv=False))
    save_model(vae, dest / "vae")
    FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    ).save_pretrained(dest / "scheduler")

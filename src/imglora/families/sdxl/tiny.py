"""The tiny SDXL model (``tiny:sdxl``): the real layout, tiny widths, random weights (see ``imglora.models.tiny``)."""

from __future__ import annotations

from pathlib import Path

from ...models.tiny import save_model, seeded
from .._shared import tiny_parts as tp


def build(dest: Path, seed: int) -> None:
    from diffusers import EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    vocab = tp.write_clip_tokenizer(dest / "tokenizer", pad_token="<|endoftext|>")
    tp.write_clip_tokenizer(dest / "tokenizer_2", pad_token="!")
    te1 = tp.clip_text_config(vocab, hidden_act="quick_gelu")  # CLIP ViT-L
    te2 = tp.clip_text_config(vocab, hidden_act="gelu", projection_dim=32)  # OpenCLIP bigG
    save_model(seeded(seed, "text_encoder", lambda: CLIPTextModel(te1)), dest / "text_encoder")
    save_model(seeded(seed, "text_encoder_2", lambda: CLIPTextModelWithProjection(te2)),
                dest / "text_encoder_2")

    time_dim = 8
    unet = seeded(seed, "unet", lambda: UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(16, 32, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(1, 2, 2),  # SDXL's key, which diffusers reads as the number of heads
        transformer_layers_per_block=(1, 1, 2), use_linear_projection=True, norm_num_groups=8,
        # SDXL attends to both encoders' penultimate hidden states, concatenated.
        cross_attention_dim=te1.hidden_size + te2.hidden_size,
        # 6 micro-conditioning numbers (sizes, crop), each embedded, plus te2's pooled projection.
        addition_embed_type="text_time", addition_time_embed_dim=time_dim,
        projection_class_embeddings_input_dim=6 * time_dim + te2.projection_dim,
    ))
    save_model(unet, dest / "unet")
    save_model(seeded(seed, "vae", lambda: tp.vae(4, scaling_factor=0.13025)), dest / "vae")
    EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type="epsilon", interpolation_type="linear", use_karras_sigmas=False,
        timestep_spacing="leading", steps_offset=1,
    ).save_pretrained(dest / "scheduler")
    tp.write_model_index(dest, "StableDiffusionXLPipeline", {
        "scheduler": ("diffusers", "EulerDiscreteScheduler"),
        "text_encoder": ("transformers", "CLIPTextModel"),
        "text_encoder_2": ("transformers", "CLIPTextModelWithProjection"),
        "tokenizer": ("transformers", "CLIPTokenizer"),
        "tokenizer_2": ("transformers", "CLIPTokenizer"),
        "unet": ("diffusers", "UNet2DConditionModel"),
        "vae": ("diffusers", "AutoencoderKL"),
    }, force_zeros_for_empty_prompt=True, add_watermarker=None)

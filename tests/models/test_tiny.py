"""Tiny models: built offline, deterministic, and loadable by the real diffusers/transformers classes."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from imglora.models import tiny
from imglora.errors import ModelSourceError
from imglora.families import registry

KINDS = registry.names()

PROMPT = "a photo of sks toy, red ball"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """Each kind built once with seed 0 for the whole module."""
    root = tmp_path_factory.mktemp("tiny")
    for kind in KINDS:
        tiny.build_tiny(registry.get(kind), root / kind, seed=0)
    return {kind: root / kind for kind in KINDS}


@pytest.fixture(scope="module")
def sdxl(built):
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(built["sdxl"])


@pytest.fixture(scope="module")
def flux(built):
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(built["flux"])


def _digests(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


# --- SDXL ------------------------------------------------------------------------------------------


def test_sdxl_generates_an_image(sdxl):
    import torch

    args = dict(prompt=PROMPT, num_inference_steps=2, height=64, width=64)
    image = sdxl(**args, generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (64, 64)
    array = sdxl(**args, generator=torch.Generator().manual_seed(0), output_type="np").images
    assert array.shape == (1, 64, 64, 3)
    assert np.isfinite(array).all()


def test_sdxl_has_the_real_structure(sdxl):
    unet, te1, te2 = sdxl.unet.config, sdxl.text_encoder.config, sdxl.text_encoder_2.config
    assert unet.addition_embed_type == "text_time"
    assert unet.cross_attention_dim == te1.hidden_size + te2.hidden_size
    assert unet.projection_class_embeddings_input_dim == 6 * unet.addition_time_embed_dim + te2.projection_dim
    assert unet.down_block_types == ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"]
    names = {name for name, _ in sdxl.unet.named_modules()}
    for proj in ("to_q", "to_k", "to_v", "to_out.0"):
        assert f"down_blocks.1.attentions.0.transformer_blocks.0.attn1.{proj}" in names
        assert f"up_blocks.0.attentions.2.transformer_blocks.1.attn2.{proj}" in names
    assert sdxl.vae_scale_factor == 8
    assert sdxl.vae.config.latent_channels == 4 and sdxl.vae.config.scaling_factor == 0.13025
    assert te1.max_position_embeddings == te2.max_position_embeddings == 77
    sched = sdxl.scheduler.config
    assert type(sdxl.scheduler).__name__ == "EulerDiscreteScheduler"
    assert (sched.num_train_timesteps, sched.beta_start, sched.beta_end, sched.beta_schedule) == (
        1000, 0.00085, 0.012, "scaled_linear")
    assert (sched.prediction_type, sched.timestep_spacing, sched.steps_offset) == ("epsilon", "leading", 1)


def test_clip_tokenizers_cover_the_prompt(sdxl):
    expected = ["a</w>", "photo</w>", "of</w>", "sks</w>", "toy</w>", ",</w>", "red</w>", "ball</w>"]
    for tok in (sdxl.tokenizer, sdxl.tokenizer_2):
        ids = tok(PROMPT, add_special_tokens=False).input_ids
        assert tok.unk_token_id not in ids
        assert tok.convert_ids_to_tokens(ids) == expected
        assert tok.model_max_length == 77
        # Any printable ASCII text tokenizes without unknowns (byte-level alphabet).
        assert tok.unk_token_id not in tok("~Zebra_42 {x}|@#", add_special_tokens=False).input_ids
    assert sdxl.tokenizer.pad_token == "<|endoftext|>"
    assert sdxl.tokenizer_2.pad_token == "!"
    # CLIP pools at the highest id, which must be <|endoftext|>.
    assert sdxl.tokenizer.eos_token_id == len(sdxl.tokenizer) - 1 == sdxl.text_encoder.config.vocab_size - 1


def test_tokenizers_cover_the_sample_captions(sdxl, flux, sample_dataset):
    captions = [line for f in sorted(sample_dataset.glob("*.txt")) for line in f.read_text().splitlines()]
    assert captions
    for tok in (sdxl.tokenizer, sdxl.tokenizer_2, flux.tokenizer_2):
        for caption in captions:
            assert tok.unk_token_id not in tok(caption, add_special_tokens=False).input_ids, caption


# --- FLUX ------------------------------------------------------------------------------------------


def test_flux_generates_an_image(flux):
    import torch

    args = dict(prompt=PROMPT, num_inference_steps=2, height=64, width=64, max_sequence_length=32)
    image = flux(**args, generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (64, 64)
    array = flux(**args, generator=torch.Generator().manual_seed(0), output_type="np").images
    assert array.shape == (1, 64, 64, 3)
    assert np.isfinite(array).all()


def test_flux_has_the_real_structure(flux):
    assert len(flux.transformer.transformer_blocks) == 4
    assert len(flux.transformer.single_transformer_blocks) == 8
    tcfg = flux.transformer.config
    assert tcfg.guidance_embeds and tcfg.in_channels == 4 * flux.vae.config.latent_channels == 64
    assert tcfg.joint_attention_dim == flux.text_encoder_2.config.d_model
    assert tcfg.pooled_projection_dim == flux.text_encoder.config.hidden_size
    vae = flux.vae.config
    assert (vae.latent_channels, vae.scaling_factor, vae.shift_factor) == (16, 0.3611, 0.1159)
    assert not vae.use_quant_conv and not vae.use_post_quant_conv
    assert flux.vae_scale_factor == 8
    sched = flux.scheduler.config
    assert (sched.shift, sched.use_dynamic_shifting) == (3.0, True)
    assert (sched.base_shift, sched.max_shift) == (0.5, 1.15)
    assert (sched.base_image_seq_len, sched.max_image_seq_len) == (256, 4096)


def test_t5_tokenizer(flux):
    tok = flux.tokenizer_2
    ids = tok(PROMPT).input_ids
    assert tok.unk_token_id not in ids and ids[-1] == tok.eos_token_id
    assert tok.convert_ids_to_tokens(ids[:3]) == ["▁a", "▁photo", "▁of"]
    assert (tok.pad_token, tok.eos_token, tok.unk_token) == ("<pad>", "</s>", "<unk>")
    assert tok.model_max_length == 512
    assert len(tok) <= flux.text_encoder_2.config.vocab_size


# --- LLM -------------------------------------------------------------------------------------------


def test_llm_generates_and_renders_chatml(built):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["llm"])
    model = AutoModelForCausalLM.from_pretrained(built["llm"])
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.vocab_size == len(tok)
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert model.config.eos_token_id == tok.eos_token_id

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."}]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n")
    prompt = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert prompt.endswith("<|im_start|>assistant\n")

    inputs = tok(prompt, return_tensors="pt")
    # Special tokens stay whole; text round-trips through the byte-level BPE.
    assert inputs.input_ids[0, 0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(inputs.input_ids[0]) == prompt
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, inputs.input_ids.shape[1] + 4)


# --- building --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_build_is_deterministic_small_and_offline_format(kind, built, tmp_path):
    tiny.build_tiny(registry.get(kind), tmp_path / kind, seed=0)
    assert _digests(tmp_path / kind) == _digests(built[kind])
    assert _size(built[kind]) < 10 * 2**20
    # Real layouts: safetensors only, no pickled weights.
    assert not list(built[kind].rglob("*.bin"))
    assert list(built[kind].rglob("*.safetensors"))


def test_seed_changes_the_weights(built, tmp_path):
    tiny.build_tiny(registry.get("sdxl"), tmp_path, seed=1)
    weights = "unet/diffusion_pytorch_model.safetensors"
    assert _digests(tmp_path)[weights] != _digests(built["sdxl"])[weights]


def test_ensure_tiny_builds_once(tmp_path):
    first = tiny.ensure_tiny(registry.get("llm"), root=tmp_path)
    assert first == tiny.tiny_dir("llm", tmp_path) == tmp_path / "tiny" / f"llm-v{tiny.TINY_VERSION}"
    mtimes = {f: f.stat().st_mtime_ns for f in first.rglob("*")}
    assert tiny.ensure_tiny(registry.get("llm"), root=tmp_path) == first
    assert {f: f.stat().st_mtime_ns for f in first.rglob("*")} == mtimes
    assert [p.name for p in first.parent.iterdir() if not p.name.endswith(".lock")] == [first.name]


def test_ensure_tiny_never_trusts_a_half_built_folder(tmp_path, monkeypatch):
    def crash(dest: Path, seed: int) -> None:
        (dest / "config.json").write_text("{}")
        raise RuntimeError("killed mid-build")

    from imglora.families.llm import tiny as llm_tiny

    monkeypatch.setattr(llm_tiny, "build", crash)
    with pytest.raises(RuntimeError, match="killed"):
        tiny.ensure_tiny(registry.get("llm"), root=tmp_path)
    dest = tiny.tiny_dir("llm", tmp_path)
    assert not dest.exists()
    assert [p.name for p in dest.parent.iterdir() if not p.name.endswith(".lock")] == []

    # A folder without the completion marker (e.g. copied by hand) is rebuilt, not trusted.
    monkeypatch.undo()
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}")
    assert tiny.ensure_tiny(registry.get("llm"), root=tmp_path) == dest
    assert (dest / "model.safetensors").is_file()


def test_ensure_tiny_concurrent_callers_share_one_build(tmp_path):
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(tiny.ensure_tiny(registry.get("llm"), root=tmp_path)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tiny.tiny_dir("llm", tmp_path)] * 2
    assert (results[0] / "model.safetensors").is_file()
    assert [p.name for p in results[0].parent.iterdir() if not p.name.endswith(".lock")] == [results[0].name]


def test_a_tiny_model_of_another_family_names_the_right_one():
    from imglora.models.resolve import resolve_model

    with pytest.raises(ModelSourceError, match=r"'tiny:sd15' is a tiny sd15 model, but model.family = 'flux'; "
                                               r"use tiny:flux"):
        resolve_model("tiny:sd15", registry.get("flux"))
    with pytest.raises(KeyError, match=f"no family 'sd15'; known: {', '.join(registry.names())}"):
        registry.get("sd15")


def test_home_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("IMGLORA_HOME", str(tmp_path))
    assert tiny.imglora_home() == tmp_path
    assert tiny.tiny_dir("flux") == tmp_path / "tiny" / f"flux-v{tiny.TINY_VERSION}"
    monkeypatch.delenv("IMGLORA_HOME")
    assert tiny.imglora_home() == Path.home() / ".cache" / "imglora"


def test_import_is_cheap():
    code = ("import sys, imglora.models.tiny; "
            "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

"""FLUX.2 [dev] on a tiny model of its layout (Mistral-Small-3's generation model, its tokenizer with a
chat template of Mistral's form, the guidance-embedding transformer): captions cached as
Flux2Pipeline encodes them (BFL's system message, layers 10, 20 and 30 side by side, padded), with
Mistral's tokenizer alone (transformers builds the Pixtral processor only with torchvision); a short
run whose evaluation at strength 0 is Flux2Pipeline's own image with its embedded guidance."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from imglora.commands.common import load_config
from imglora.commands.train import train
from imglora.errors import ModelSourceError
from imglora.families import registry
from imglora.families.flux2 import model as f2
from imglora.models.resolve import resolve_model
from imglora.models.tiny import save_model, seeded
from imglora.util.owned import own_module

REPO = Path(__file__).resolve().parents[2]
q = lambda p: json.dumps(str(p))  # noqa: E731
# BFL's system message's words, so the tiny tokenizer cuts it in words as a real one would
WORDS = ("You", "are", "AI", "that", "reasons", "about", "image", "descriptions", "give", "structured", "responses",
         "focusing", "on", "object", "relationships", "attribution", "and", "actions", "without", "speculation")
# Mistral-Small-3's chat template for text turns: [SYSTEM_PROMPT]…[/SYSTEM_PROMPT][INST]…[/INST] after <s>
TEMPLATE = ("{{- bos_token }}{%- for m in messages %}{%- set text = m['content'] if m['content'] is string else "
            "m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
            "{%- if m['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
            "{%- elif m['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}{%- endif %}{%- endfor %}")


def build_tiny_dev(dest: Path) -> Path:
    """The tiny [dev]: its Mistral has more layers than the 30 FLUX.2 reads, as the real one (40), so that
    hidden_states[30] is a layer's output before the final norm there too."""
    from diffusers import Flux2Transformer2DModel
    from transformers import AutoTokenizer, Mistral3Config, Mistral3ForConditionalGeneration

    from imglora.families._shared import tiny_parts as tp

    tp.write_qwen2_tokenizer(dest / "tokenizer", WORDS)
    tok = AutoTokenizer.from_pretrained(dest / "tokenizer")
    tok.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "additional_special_tokens":
                            ["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]"]})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(dest / "tokenizer")
    config = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=2048, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=64, patch_size=16),
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2)
    save_model(seeded(0, "text_encoder", lambda: Mistral3ForConditionalGeneration(config)), dest / "text_encoder")
    klein = resolve_model("tiny:flux2", registry.get("flux2")).root
    shutil.copytree(klein / "vae", dest / "vae")  # (FLUX.2's one VAE)
    save_model(seeded(0, "transformer", lambda: Flux2Transformer2DModel(
        in_channels=128, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=3 * 16, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)), dest / "transformer")
    shutil.copytree(f2.MODELS["dev"] / "scheduler", dest / "scheduler")
    tp.write_model_index(dest, "Flux2Pipeline", {
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_encoder": ("transformers", "Mistral3ForConditionalGeneration"),
        "tokenizer": ("transformers", "PreTrainedTokenizerFast"),  # (the real model's: PixtralProcessor)
        "transformer": ("diffusers", "Flux2Transformer2DModel"),
        "vae": ("diffusers", "AutoencoderKLFlux2"),
    })
    return dest


@pytest.fixture(scope="module")
def dev(tmp_path_factory) -> Path:
    return build_tiny_dev(tmp_path_factory.mktemp("flux2-dev") / "model")


def pipeline(root: Path):
    from diffusers import Flux2Pipeline

    pipe = Flux2Pipeline.from_pretrained(root)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            own_module(component)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_dev_captions_are_the_pipelines_mistral_states(dev: Path, tmp_path: Path) -> None:
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    family = registry.get("flux2")
    src = resolve_model(str(dev), family)
    encoders = family.load_text_encoders(src, torch.device("cpu"), torch.float32)
    assert encoders[2] == "dev" and f2.DEV_SYSTEM == SYSTEM_MESSAGE
    pipe = pipeline(dev)
    for caption in ("a photo of sks toy on a wooden table", "", "an [IMG] token"):
        want = pipe._get_mistral_3_small_prompt_embeds(pipe.text_encoder, pipe.tokenizer, caption,
                                                       max_sequence_length=40)[0]
        got = family.encode_text(encoders, caption, 40)["prompt_embeds"]
        # The same tokens through the same model with the same padding: layers 10, 20, 30 side by side.
        assert got.shape == (40, 3 * 16) and torch.equal(got, want)
    n = len(encoders[0]("a photo of sks toy", add_special_tokens=False).input_ids)
    assert family.count_tokens(encoders, "a photo of sks toy", 40) == {"Mistral": (n, 40)}

    # The template kept beside a processor's config (chat_template.json) is found; none at all is named.
    folder = tmp_path / "tokenizer"
    shutil.copytree(dev / "tokenizer", folder)
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert f2.mistral_tokenizer(folder).chat_template == TEMPLATE
    (folder / "chat_template.json").unlink()
    with pytest.raises(ModelSourceError, match=r"tokenizer: no chat template for Mistral's tokenizer"):
        f2.mistral_tokenizer(folder)


@pytest.mark.slow  # (a run and its evaluation: CI runs it)
def test_a_dev_run_trains_and_evaluates_as_flux2_pipeline_with_its_guidance(dev: Path, tmp_path: Path,
                                                                            sample_dataset: Path) -> None:
    from PIL import Image

    from imglora.commands.evaluate import evaluate

    data = tmp_path / "data"
    data.mkdir()
    for stem in ("01_sky", "02_grass"):
        for f in sample_dataset.glob(f"{stem}.*"):
            shutil.copy(f, data / f.name)
    cfg = load_config(REPO / "presets" / "tiny-flux2.toml", [
        f"model.path={q(dev)}", f"data.dir={q(data)}", f"cache.dir={q(tmp_path / 'cache')}",
        f"run.output_dir={q(tmp_path / 'runs')}", "data.buckets=false", "data.resolution=64", "train.max_steps=2",
        "train.warmup_steps=0", "train.learning_rate=0.03", "eval.strengths=[0, 1]", "eval.sample_steps=2",
        "eval.guidance_scale=4.0"])
    result = train(cfg, out=lambda s: None)
    record = json.loads(result.record.read_text())
    assert result.steps_done == 2 and np.isfinite(record["final_loss"]) and record["model_facts"]["variant"] == "dev"
    ev = evaluate(cfg.run_dir, overrides=['eval.fp8="off"', "eval.blocks_to_swap=0"], out=lambda s: None)
    (step,) = ev.images
    prompt = registry.get("flux2").default_prompts(cfg)[0]
    base = pipeline(dev)(prompt=prompt, guidance_scale=4.0, height=64, width=64, num_inference_steps=2,
                         max_sequence_length=cfg.cache.text_max_length,
                         generator=torch.Generator().manual_seed(0)).images[0]
    got = [np.asarray(Image.open(p).convert("RGB")) for p in ev.images[step][0]]
    assert np.abs(got[0].astype(int) - np.asarray(base).astype(int)).max() <= 1  # float32 rounding
    assert np.abs(got[1].astype(int) - np.asarray(base).astype(int)).max() > 2  # the adapter at strength 1

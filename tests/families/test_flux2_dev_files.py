"""FLUX.2 [dev]'s Mistral-Small-3 as Comfy-Org publishes it (flux2-dev's
``split_files/text_encoders/mistral_3_small_flux2_bf16.safetensors`` / ``_fp8``): the language model in
transformers' MistralModel names under ``model.`` (ComfyUI's Llama2_ module names), the vision tower and
projector beside it, Mistral's tekken tokenizer as a byte tensor, and either all the layers or ComfyUI's
cut to the 30 FLUX.2 reads (comfy/sd.py::detect_te_model's MISTRAL3_24B_PRUNED_FLUX2).

The file is written here from the tiny [dev]'s Mistral3 generation model (32 layers: like the real
40-layer one, its hidden_states[30] is a layer's output before the final norm), in the
transformers -> ComfyUI direction, and read back: the states [dev] caches equal the folder model's bit for
bit, from the full file and from the cut one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_flux2_dev import build_tiny_dev

from imglora.util.owned import own_module
from imglora.errors import ModelSourceError
from imglora.families import registry
from imglora.families._shared.singlefile import inspect
from imglora.families._shared.singlefile.inspect import describe
from imglora.families.flux2 import singlefile
from imglora.families.flux2.model import DEV_LAYERS
from imglora.models.resolve import resolve_model
from imglora.models.source import ModelSource

CPU = torch.device("cpu")
LANGUAGE = "model.language_model."  # transformers' Mistral3 names of its language model


@pytest.fixture(scope="module")
def dev(tmp_path_factory) -> Path:
    return build_tiny_dev(tmp_path_factory.mktemp("flux2-dev-files") / "model")


@pytest.fixture(scope="module")
def generation(dev: Path):
    from transformers import Mistral3ForConditionalGeneration

    return own_module(Mistral3ForConditionalGeneration.from_pretrained(dev / "text_encoder")).eval()  # (aligned)


@pytest.fixture
def mistral_as_small(monkeypatch):
    """The tiny Mistral is 16 wide: accepted as Mistral-Small-3 here (the real one is 5120)."""
    real = inspect.classify
    monkeypatch.setattr(inspect, "classify", lambda r: inspect.Layout(kind="mistral3-small", path=r.path, prefix="model.")
                        if inspect.MISTRAL_KEY in r.key_set else real(r))


def comfyui_mistral(generation, out: Path, *, layers: int | None = None, drop: str = "") -> Path:
    """mistral_3_small_flux2_*.safetensors: the language model under model. (its first ``layers`` only,
    the final norm kept, as ComfyUI's cut file keeps it), vision_tower.* and multi_modal_projector.*
    beside it, the tokenizer as tekken_model (bytes); no LM head."""
    sd = {}
    for k, v in generation.state_dict().items():
        if k.startswith(LANGUAGE):
            name = "model." + k[len(LANGUAGE):]
            if layers is not None and name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
                continue
        elif k.startswith("model."):
            name = k[len("model."):]
        else:
            continue  # lm_head
        sd[name] = v.detach().clone().contiguous()
    sd["tekken_model"] = torch.tensor(list(b'{"config": {}, "vocab": []}'), dtype=torch.uint8)
    sd.pop(drop, None)
    save_file(sd, out)
    return out


def zeros(out: Path, shapes: dict[str, tuple[int, ...]]) -> Path:
    save_file({k: torch.zeros(s) for k, s in shapes.items()}, out)
    return out


def test_the_file_is_told_apart_from_its_header(tmp_path: Path, generation) -> None:
    norm = "model.layers.{}.post_attention_layernorm.weight"
    cut = zeros(tmp_path / "cut.safetensors", {"model.embed_tokens.weight": (1, 5120), norm.format(0): (5120,),
                                                norm.format(29): (5120,), "vision_tower.x.weight": (1,)})
    full = zeros(tmp_path / "full.safetensors", {"model.embed_tokens.weight": (1, 5120), norm.format(0): (5120,),
                                                 norm.format(39): (5120,)})
    assert (describe(cut).kind, describe(cut).variant) == ("mistral3-small", "pruned")
    assert (describe(full).kind, describe(full).variant) == ("mistral3-small", "full")
    llama = zeros(tmp_path / "llama.safetensors", {"model.embed_tokens.weight": (1, 4096), norm.format(0): (4096,)})
    assert "a Llama-layout text encoder of width 4096" in str(describe(llama))
    gemma = zeros(tmp_path / "gemma.safetensors", {norm.format(0): (5120,),
                                                   "model.layers.0.post_feedforward_layernorm.weight": (5120,)})
    assert describe(gemma).kind == "unknown"
    qwen3 = zeros(tmp_path / "q.safetensors", {"model.embed_tokens.weight": (1, 2560), norm.format(0): (2560,),
                                               "model.layers.0.self_attn.q_norm.weight": (1,)})
    assert describe(qwen3).kind == "qwen3-4b"
    tiny = describe(comfyui_mistral(generation, tmp_path / "tiny.safetensors"))
    assert tiny.kind == "unknown" and "width 16" in tiny.note
    with pytest.raises(ModelSourceError, match=r"q.safetensors is not Mistral-Small-3 \(24B\), FLUX.2 \[dev\]'s text "
                                               r"encoder .*it looks like qwen3-4b"):
        inspect.expect(qwen3, singlefile.MISTRAL_KIND)


def test_comfyuis_file_gives_the_folders_states_bit_for_bit(dev: Path, generation, tmp_path: Path,
                                                            mistral_as_small) -> None:
    from transformers import MistralModel

    family = registry.get("flux2")
    folder = family.load_text_encoders(resolve_model(str(dev), family), CPU, torch.float32)
    language = {k[len(LANGUAGE):]: v for k, v in generation.state_dict().items() if k.startswith(LANGUAGE)}
    ids = torch.randint(0, generation.config.text_config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.no_grad():
        want = generation(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
    for layers in (None, 30):  # the whole model's 32 layers, and ComfyUI's cut
        path = comfyui_mistral(generation, tmp_path / f"mistral{layers}.safetensors", layers=layers)
        encoders = family.load_text_encoders(ModelSource(dev, {"text_encoder": path}), CPU, torch.float32)
        tokenizer, encoder, kind = encoders
        assert kind == "dev" and isinstance(encoder, MistralModel) and len(encoder.layers) == max(DEV_LAYERS) == 30
        got = encoder.state_dict()
        assert all(torch.equal(got[k], language[k]) for k in got) and "norm.weight" not in got
        with torch.no_grad():
            states = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
        assert all(torch.equal(states[k], want[k]) for k in (10, 20, 30))
        for caption in ("a photo of sks toy on a wooden table", ""):
            assert torch.equal(family.encode_text(encoders, caption, 40)["prompt_embeds"],
                               family.encode_text(folder, caption, 40)["prompt_embeds"])


def test_a_missing_layer_names_the_file_and_the_key(generation, dev: Path, tmp_path: Path, mistral_as_small) -> None:
    path = comfyui_mistral(generation, tmp_path / "gone.safetensors", layers=30,
                           drop="model.layers.29.mlp.down_proj.weight")
    with pytest.raises(ModelSourceError, match=r"gone.safetensors: the FLUX.2 \[dev\] Mistral-Small-3 text encoder does not fit "
                                               r".*1 missing: layers.29.mlp.down_proj.weight"):
        singlefile.load_mistral(ModelSource(dev, {"text_encoder": path}), torch.float32)
    path = comfyui_mistral(generation, tmp_path / "short.safetensors", layers=20)
    with pytest.raises(ModelSourceError, match=r"short.safetensors: .*missing: layers.20.input_layernorm.weight"):
        singlefile.load_mistral(ModelSource(dev, {"text_encoder": path}), torch.float32)

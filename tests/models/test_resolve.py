from __future__ import annotations

from pathlib import Path

import pytest

from imglora.families import get_family
from imglora.errors import ModelSourceError
from imglora.models.resolve import resolve_model


def test_hub_id_missing_from_local_cache_names_it_and_how_to_download(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf"))
    with pytest.raises(ModelSourceError) as exc:
        resolve_model("black-forest-labs/FLUX.1-dev", get_family("flux"))
    msg = str(exc.value)
    assert "'black-forest-labs/FLUX.1-dev' is not in the local Hugging Face cache" in msg
    assert "hf download black-forest-labs/FLUX.1-dev" in msg


def test_hub_id_found_in_local_cache(tmp_path: Path, monkeypatch) -> None:
    # The layout huggingface_hub writes: models--owner--name/{refs/main, snapshots/<rev>/...}
    repo = tmp_path / "hf" / "models--someone--tiny-sdxl"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "model_index.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf"))
    assert resolve_model("someone/tiny-sdxl", get_family("sdxl")).root == snap


def test_local_folder_must_be_in_the_family_format(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="has no model_index.json; the sdxl family needs a diffusers-format"):
        resolve_model(str(tmp_path), get_family("sdxl"))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path), get_family("llm")).root == tmp_path


def test_bad_paths(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(ModelSourceError, match="model.safetensors is not a readable safetensors file .*0 bytes"):
        resolve_model(str(f), get_family("sdxl"))
    with pytest.raises(ModelSourceError, match="is a file; the llm family loads a model folder"):
        resolve_model(str(f), get_family("llm"))
    with pytest.raises(ModelSourceError, match="no such folder"):
        resolve_model(str(tmp_path / "nope" / "deeper" / "x"), get_family("sdxl"))
    with pytest.raises(ModelSourceError, match="use tiny:flux"):
        resolve_model("tiny:sdxl", get_family("flux"))
    with pytest.raises(ModelSourceError, match="'tiny:sd15' is a tiny sd15 model, but model.family = 'sdxl'; use tiny:sdxl"):
        resolve_model("tiny:sd15", get_family("sdxl"))


def test_tiny_models_resolve_to_their_built_folder() -> None:
    for kind, marker in (("sdxl", "model_index.json"), ("flux", "model_index.json"), ("llm", "config.json")):
        folder = resolve_model(f"tiny:{kind}", get_family(kind)).root
        assert (folder / marker).is_file()


def test_hf_blob_checksum_is_taken_from_its_name(tmp_path: Path) -> None:
    from imglora.runs import record

    digest = "ab" * 32
    blob = tmp_path / "blobs" / digest
    blob.parent.mkdir()
    blob.write_bytes(b"not hashed: the name is the sha256 of an LFS file's content")
    link = tmp_path / "snapshots" / "rev" / "model.safetensors"
    link.parent.mkdir(parents=True)
    link.symlink_to(blob)
    assert record.cached_sha256(link) == digest
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"abc")
    assert record.cached_sha256(plain) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def _with_pickled(tiny: Path, dest: Path, part: str, name: str) -> Path:
    """A copy of a tiny model whose ``part`` ("" for the root) holds its weights as a torch.save pickle
    ``name`` instead of the .safetensors file (as older hub repos and some conversions do)."""
    import shutil

    import torch
    from safetensors.torch import load_file

    shutil.copytree(tiny, dest)
    folder = dest / part
    for f in folder.glob("*.safetensors"):
        torch.save(load_file(str(f)), folder / name)
        f.unlink()
    return folder / name


def test_a_folder_whose_weights_are_a_pickle_is_refused_before_loading(tmp_path: Path, monkeypatch) -> None:
    import diffusers

    from imglora.models.tiny import ensure_tiny

    family = get_family("sdxl")
    pickled = _with_pickled(ensure_tiny(family), tmp_path / "sdxl", "vae", "diffusion_pytorch_model.bin")
    monkeypatch.setattr(diffusers.AutoencoderKL, "from_pretrained",
                        lambda *a, **k: pytest.fail("the pickled VAE was loaded"))
    with pytest.raises(ModelSourceError) as exc:
        resolve_model(str(tmp_path / "sdxl"), family)
    msg = str(exc.value)
    assert f"{pickled} is a pickle file; imglora loads weights from .safetensors files only" in msg
    assert f"'{pickled.with_suffix('.safetensors')}'" in msg  # the conversion writes what diffusers reads
    llm = get_family("llm")
    pickled = _with_pickled(ensure_tiny(llm), tmp_path / "llm", "", "pytorch_model.bin")
    with pytest.raises(ModelSourceError, match=f"{pickled} is a pickle file"):
        resolve_model(str(tmp_path / "llm"), llm)


def test_a_pickle_beside_its_safetensors_is_not_refused(tmp_path: Path) -> None:
    import shutil

    import torch

    from imglora.models.tiny import ensure_tiny

    shutil.copytree(ensure_tiny(get_family("sdxl")), tmp_path / "sdxl")
    torch.save({}, tmp_path / "sdxl" / "vae" / "diffusion_pytorch_model.bin")  # the loaders take the .safetensors
    assert resolve_model(str(tmp_path / "sdxl"), get_family("sdxl")).root == tmp_path / "sdxl"


def test_the_cli_refuses_a_pickled_component_with_exit_1(tmp_path: Path, small_run) -> None:
    import json

    from click.testing import CliRunner

    from imglora.cli import main
    from imglora.models.tiny import ensure_tiny

    pickled = _with_pickled(ensure_tiny(get_family("sdxl")), tmp_path / "sdxl", "vae", "diffusion_pytorch_model.bin")
    args = ["cache-latents", str(Path(__file__).parents[2] / "presets" / "tiny-sdxl.toml"),
            *[x for o in small_run() for x in ("--set", o)], "--set", f"model.path={json.dumps(str(tmp_path / 'sdxl'))}"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and f"{pickled} is a pickle file" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.safetensors"))

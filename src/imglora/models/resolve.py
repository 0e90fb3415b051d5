"""Where a model is on this machine (``ModelSource``), found without ever touching the network.

``model.path`` is one of:
- ``tiny:<family>``: a tiny random model imglora builds on first use;
- a local folder in the family's layout (diffusers: ``model_index.json``; transformers: ``config.json``);
- a hub id such as ``black-forest-labs/FLUX.1-dev``, looked up only in the local Hugging Face cache;
- a single ``.safetensors`` file (an SDXL checkpoint, a FLUX.1 transformer) with, where the family
  needs them, its other parts as files (``model.vae``, ``model.text_encoder``,
  ``model.text_encoder_2``); with ``model.comfyui`` these may be bare file names, found in
  ComfyUI's model folders as ComfyUI finds them. The family says what its files must be
  (``SingleFiles``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from . import tiny
from ..config import ModelConfig
from ..errors import ModelSourceError
from ..family import SingleFiles, supports
from .source import ModelSource

if TYPE_CHECKING:
    from ..family import Family

WEIGHT_FILE_SUFFIXES = (".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".bin")


def resolve_model(model: ModelConfig | str, family: "Family") -> ModelSource:
    """``model`` (the preset's [model] section, or just a path) as a ``ModelSource``."""
    path = model if isinstance(model, str) else model.path
    if path.startswith("tiny:"):
        kind = path.removeprefix("tiny:")
        if kind != family.name:
            raise ModelSourceError(f"model.path = {path!r} is a tiny {kind} model, but model.family = "
                                   f"{family.name!r}; use tiny:{family.name}")
        return ModelSource(tiny.ensure_tiny(family))
    local = Path(path).expanduser()
    if local.is_dir():
        return ModelSource(_check_folder(local, family, path))
    if local.is_file() or local.suffix.lower() in WEIGHT_FILE_SUFFIXES:
        if not supports(family, SingleFiles):
            raise ModelSourceError(f"model.path = {path!r} is a file; the {family.name} family loads a model folder "
                                   f"(with {family.model_marker}) or a hub id")
        if isinstance(model, str):
            model = ModelConfig(family=family.name, path=model)
        return family.resolve_files(model, FileFinder(model))
    if looks_like_hub_id(path):
        return ModelSource(_check_folder(_from_hf_cache(path, family), family, path))
    raise ModelSourceError(f"model.path = {path!r}: no such folder or file, and it is not a hub id "
                           "(owner/name) either; check the path")


class FileFinder:
    """Finds a model file named in the preset: a path, or with ``model.comfyui`` a bare name in
    ComfyUI's folder of that kind (checkpoints, diffusion_models, text_encoders, vae)."""

    def __init__(self, model: ModelConfig):
        self.comfyui = model.comfyui

    def __call__(self, name: str, kinds: tuple[str, ...], setting: str) -> Path:
        path = Path(name).expanduser()
        if path.is_file():
            return path
        if self.comfyui and not path.is_absolute():
            from .comfyui import find_model_file, model_folders

            try:  # a fault of the ComfyUI folder or its YAML is the same for every kind: said once
                model_folders(self.comfyui, kinds[0])
            except ModelSourceError as exc:
                raise ModelSourceError(f"{setting} = {name!r}: {exc}") from None
            errors = []
            for kind in kinds:
                try:
                    return find_model_file(self.comfyui, kind, name)
                except ModelSourceError as exc:
                    errors.append(str(exc))
            raise ModelSourceError(f"{setting} = {name!r}: " + " ".join(errors))
        where = "" if self.comfyui else "; or set model.comfyui to your ComfyUI folder to give bare file names"
        raise ModelSourceError(f"{setting} = {name!r}: no such file ({path.resolve()}){where}")


def looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~"))


def hub_snapshot(repo_id: str) -> Path | None:
    """The local Hugging Face cache's snapshot of ``repo_id``, or None (never a download)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, HFValidationError):
        return None


def _from_hf_cache(repo_id: str, family: "Family") -> Path:
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError

    from .fetch import missing_model_hint

    try:
        folder = hub_snapshot(repo_id)
    except HFValidationError as exc:
        raise ModelSourceError(f"model.path = {repo_id!r} is not a valid hub id: {exc}") from None
    if folder is None:
        raise ModelSourceError(
            f"model.path = {repo_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}). imglora "
            f"never downloads during a run; {missing_model_hint(repo_id, family)} (gated models "
            "also need `hf auth login` and the license accepted on the model page), "
            "or set model.path to a local folder or to the model's single .safetensors file.")
    return folder


def _check_folder(folder: Path, family: "Family", shown: str) -> Path:
    marker = family.model_marker
    if not (folder / marker).is_file():
        fmt = "diffusers" if marker == "model_index.json" else "transformers"
        raise ModelSourceError(f"model.path = {shown!r} ({folder}) has no {marker}; the {family.name} family "
                               f"needs a {fmt}-format folder")
    refuse_pickled_weights(folder)
    return folder


# The weights names diffusers and transformers fall back to, and unpickle, when a component folder
# has no .safetensors file (diffusion_pytorch_model.bin, pytorch_model-00001-of-00002.bin, ...).
PICKLED_WEIGHTS_PREFIXES = ("diffusion_pytorch_model", "pytorch_model")


def refuse_pickled_weights(folder: Path) -> None:
    """Refuse a model folder, or one of its component folders, whose weights are only ``torch.save``
    pickles: the loaders would unpickle them (weights_only=True narrows what a pickle can do, but it
    is still a pickle). Where a .safetensors file is beside the pickle, the loaders take that one."""
    from .safefiles import pickle_refusal

    for part in (folder, *sorted(p for p in folder.iterdir() if p.is_dir())):
        files = [p for p in part.iterdir() if p.is_file()]
        if any(p.name.endswith(".safetensors") for p in files):
            continue
        pickles = sorted(p for p in files if p.suffix == ".bin" and p.name.startswith(PICKLED_WEIGHTS_PREFIXES))
        if pickles:
            raise pickle_refusal(pickles[0])

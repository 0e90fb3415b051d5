"""``imglora fetch``: download exactly the files a preset's run will read, and nothing else.

A hub id in ``model.path`` names a whole repository, and ``hf download ID`` takes all of it:
black-forest-labs/FLUX.1-dev holds the 23.8 GB single-file checkpoint, the 23.8 GB diffusers
transformer, the text encoders and more, about 57 GB, of which a run from the diffusers folder
reads about 34. What a run reads is decided here by patterns (:func:`patterns`), the same ones the
"model not found" error prints for ``hf download --include/--exclude``:

* a diffusers model (``model_index.json``): ``model_index.json``, and the folder of each component
  it names: configs, tokenizer files and ``.safetensors`` weights -- not the weight variants
  (``*.fp16.*`` and the like, which imglora never loads), not other weight formats (``.bin``
  pickles, Flax, ONNX, GGUF), not nested folders, not the root's single files;
* a transformers model (``config.json``, the LLM family): the root's files of those kinds, nothing
  in sub-folders;
* single files named in the preset (``model.comfyui`` with bare file names): each name the family
  knows (its ``published_files``: name -> repository, path in it, ComfyUI folder kind) is one
  file, placed in the ComfyUI folder of its kind.

The repository's listing (sizes, and the sha256 of each LFS file) comes first: the total is
printed before anything is downloaded, files already in the cache are counted as there, and after
the download every file's size, and each LFS file's sha256, are checked. ``snapshot_download`` is
huggingface_hub's: an interrupted download resumes where it stopped. Weights only as pickles
(``.bin``) are refused, as the loaders refuse them. A gated repository gets one message: the page
where its licence is accepted, and ``hf auth login``.

Nothing here runs inside ``imglora train``: a run never downloads.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import ModelSourceError

# The weight variants diffusers and transformers repositories carry beside the default weights
# (``diffusion_pytorch_model.fp16.safetensors``, its shards ``...fp16-00001-of-00002.safetensors``,
# ``model.safetensors.index.fp16.json``): imglora loads the default weights only.
VARIANTS = ("fp16", "bf16", "fp32", "fp8", "int8", "non_ema", "ema")
VARIANT_EXCLUDES = tuple(f"*.{v}[.-]*" for v in VARIANTS)
# What else repositories hold that a run never reads: other weight formats (pickles, Flax, ONNX,
# TensorFlow, GGUF, OpenVINO), documents and pictures.
OTHER_EXCLUDES = tuple(f"*.{x}" for x in ("bin", "msgpack", "onnx", "onnx_data", "pb", "h5", "ot", "ckpt", "pt",
                                          "pth", "gguf", "xml", "md", "png", "jpg", "jpeg", "webp", "gif")) + (
    "LICENSE*", "NOTICE*", "USE_POLICY*", ".gitattributes")
# The HTTP libraries huggingface_hub has used (httpx2 since 2.x): their errors are network errors.
HTTP_MODULES = ("httpx", "httpx2", "requests", "urllib3")

@dataclass(frozen=True)
class HubFile:
    path: str  # in the repository
    size: int
    sha256: str | None = None  # LFS files: the hub's sha256 of the content


@dataclass
class Download:
    """One repository's part of a fetch: the files, and where they go."""

    repo: str
    revision: str | None
    files: list[HubFile]
    present: set[str] = field(default_factory=set)  # already on disk, complete
    place: dict[str, Path] = field(default_factory=dict)  # single files: path in repo -> destination

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def missing_bytes(self) -> int:
        return sum(f.size for f in self.files if f.path not in self.present)


# ---------------------------------------------------------------------------------------- patterns


def patterns(marker: str, components: list[str] | None) -> tuple[list[str], list[str]]:
    """(include, exclude) patterns of the files a run of this model reads, for huggingface_hub's
    allow/ignore patterns and ``hf download --include/--exclude`` (fnmatch: ``*`` crosses ``/``).
    ``components``: a diffusers model's, from its model_index.json. A diffusers model: model_index.json
    and each component's folder (configs, tokenizer files, .safetensors weights), nothing nested and
    nothing at the root beside model_index.json; a transformers model: the root's files."""
    if marker == "model_index.json":
        include = ["model_index.json"] + [f"{c}/*" for c in components or []]
        return include, [*VARIANT_EXCLUDES, *OTHER_EXCLUDES, "*/*/*"]
    return ["*"], [*VARIANT_EXCLUDES, *OTHER_EXCLUDES, "*/*"]


def components(model_index: dict[str, Any]) -> list[str]:
    """The component folders a diffusers model_index.json names (entries [library, class], class not null;
    not a pipeline setting that is a list too, e.g. Krea 2's text_encoder_select_layers)."""
    return sorted(k for k, v in model_index.items() if not k.startswith("_") and isinstance(v, list)
                  and len(v) == 2 and all(isinstance(x, str) for x in v))


def matches(path: str, include: list[str], exclude: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) for p in include) and not any(fnmatch.fnmatch(path, p) for p in exclude)


def looks_like_repo(repo: str) -> bool:
    parts = repo.split("/")
    return len(parts) == 2 and all(p and p.strip() == p for p in parts)


def hf_download_command(repo: str, include: list[str], exclude: list[str]) -> str:
    quote = (lambda p: f"'{p}'" if any(ch in p for ch in "*?[") else p)
    return (f"hf download {repo} --include {' '.join(quote(p) for p in include)} "
            f"--exclude {' '.join(quote(p) for p in exclude)}")


def shipped_components(family: Any) -> list[str] | None:
    """The components of the model_index.json imglora ships for ``family`` (its first config), for
    messages written without the network; None for a transformers family."""
    if family.model_marker != "model_index.json":
        return None
    import inspect

    folder = Path(inspect.getfile(type(family))).parent / "configs"
    for index in sorted(folder.glob("*/model_index.json")):
        return components(json.loads(index.read_text()))
    return None


def missing_model_hint(repo: str, family: Any) -> str:
    """What the error of a model not in the cache says to do: ``imglora fetch``, or the exact ``hf
    download`` line (the patterns fetch uses, from the components imglora knows for the family)."""
    include, exclude = patterns(family.model_marker, shipped_components(family))
    return (f"fetch exactly the files a run reads with `imglora fetch PRESET` (it prints their total size "
            f"first), or `{hf_download_command(repo, include, exclude)}`")


# -------------------------------------------------------------------------------------- the hub


class Hub:
    """The few calls of huggingface_hub that fetch needs (tests replace this object)."""

    def listing(self, repo: str, revision: str | None) -> tuple[str | None, list[HubFile]]:
        from huggingface_hub import HfApi

        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
        files = [HubFile(s.rfilename, int(s.size or 0), s.lfs.sha256 if s.lfs else None) for s in info.siblings or []]
        return info.sha, files

    def read_text(self, repo: str, path: str, revision: str | None) -> str:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo, path, revision=revision)).read_text()

    def cached(self, repo: str, path: str, revision: str | None) -> Path | None:
        from huggingface_hub import try_to_load_from_cache

        got = try_to_load_from_cache(repo, path, revision=revision)
        return Path(got) if isinstance(got, str) else None

    def snapshot(self, repo: str, revision: str | None, paths: list[str]) -> Path:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, revision=revision, allow_patterns=paths))


def _hub_error(exc: Exception, repo: str) -> ModelSourceError | None:
    """A one-line error for what the hub answered, or None when ``exc`` is not the hub's."""
    from huggingface_hub import errors

    if isinstance(exc, errors.GatedRepoError):
        return ModelSourceError(
            f"{repo} is gated: accept its licence at https://huggingface.co/{repo} while logged in, then run "
            "`hf auth login` here (or set HF_TOKEN) with a token of that account, and run imglora fetch again")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return ModelSourceError(f"{repo}: no such repository on the Hugging Face hub (or it is private: `hf auth "
                                "login` with an account that can see it); check model.path")
    if isinstance(exc, errors.RevisionNotFoundError):
        return ModelSourceError(f"{repo}: no such revision")
    if isinstance(exc, errors.OfflineModeIsEnabled):
        return ModelSourceError(f"{repo}: HF_HUB_OFFLINE is set, so nothing can be fetched; unset it to download")
    if isinstance(exc, errors.HfHubHTTPError) or type(exc).__module__.split(".")[0] in HTTP_MODULES:
        return ModelSourceError(f"{repo}: the hub could not be reached or refused ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}); check the network and try again "
                                "(a download resumes where it stopped)")
    return None


def _call(repo: str, fn: Callable[..., Any], *args: Any) -> Any:
    """A hub call; what the hub answers as an error becomes one line naming ``repo``."""
    try:
        return fn(*args)
    except Exception as exc:
        err = _hub_error(exc, repo)
        if err is None:
            raise
        raise err from None


# ------------------------------------------------------------------------------------- planning


def plan_repo(hub: Hub, repo: str, family: Any, revision: str | None = None) -> Download:
    """The files of ``repo`` a run of ``family`` reads, with their sizes, and which are on disk."""
    sha, listing = _call(repo, hub.listing, repo, revision)
    by_path = {f.path: f for f in listing}
    marker = family.model_marker
    if marker not in by_path:
        raise ModelSourceError(f"{repo} has no {marker}: it is not a model in the layout the {family.name} family "
                               f"loads ({'diffusers' if marker == 'model_index.json' else 'transformers'})")
    comps = components(json.loads(_call(repo, hub.read_text, repo, marker, sha))) if marker == "model_index.json" \
        else None
    include, exclude = patterns(marker, comps)
    chosen = sorted((f for f in listing if matches(f.path, include, exclude)), key=lambda f: f.path)
    _refuse_pickles(repo, listing, chosen, comps)
    present = set()
    for f in chosen:
        local = hub.cached(repo, f.path, sha)
        if local is not None and local.is_file() and local.stat().st_size == f.size:
            present.add(f.path)
    return Download(repo, sha, chosen, present)


def _refuse_pickles(repo: str, listing: list[HubFile], chosen: list[HubFile], comps: list[str] | None) -> None:
    """A component (or a transformers root) whose weights are only ``.bin`` pickles: refused."""
    folders = [f"{c}/" for c in comps] if comps is not None else [""]
    for folder in folders:
        def here(path: str) -> bool:
            rest = path[len(folder):]
            return path.startswith(folder) and "/" not in rest

        if any(f.path.endswith(".safetensors") and here(f.path) for f in chosen):
            continue
        pickles = sorted(f.path for f in listing if here(f.path) and f.path.endswith(".bin")
                         and Path(f.path).name.startswith(("pytorch_model", "diffusion_pytorch_model")))
        if pickles:
            raise ModelSourceError(f"{repo}: {pickles[0]} -- the weights of {folder or 'the model'} are only a pickle "
                                   "(.bin), which imglora never loads; use a repository with .safetensors weights")


def plan_single_files(hub: Hub, names: dict[str, str], comfyui: Path,
                      known: dict[str, tuple[str, str, str]]) -> list[Download]:
    """Downloads for bare single-file names (setting -> name) not yet in the ComfyUI folder;
    ``known``: the family's ``published_files``."""
    from .comfyui import find_model_file, model_folders

    out: dict[str, Download] = {}
    listings: dict[str, dict[str, HubFile]] = {}
    for setting, name in names.items():
        if name in known:
            repo, path, kind = known[name]
        else:
            raise ModelSourceError(f"{setting} = {name!r}: imglora does not know where this file is published; "
                                   f"download it yourself into {comfyui}/models/<kind>/ (known names: "
                                   f"{', '.join(sorted(known)) or 'none for this family'})")
        try:  # already in one of ComfyUI's folders of that kind (extra_model_paths.yaml included)
            find_model_file(comfyui, kind, name)
            continue
        except ModelSourceError:
            pass
        folders = model_folders(comfyui, kind)
        dest = next((f for f in folders if f.name == kind), folders[0]) / name  # models/diffusion_models, not unet
        if repo not in out:
            sha, listing = _call(repo, hub.listing, repo, None)
            out[repo], listings[repo] = Download(repo, sha, []), {f.path: f for f in listing}
        d = out[repo]
        f = listings[repo].get(path)
        if f is None:
            raise ModelSourceError(f"{setting} = {name!r}: {repo} has no {path} (any more); download the file "
                                   f"yourself into {dest.parent}")
        d.files.append(f)
        d.place[f.path] = dest
    return list(out.values())


# ------------------------------------------------------------------------------------ doing it


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def describe(downloads: list[Download]) -> list[str]:
    lines = []
    for d in downloads:
        lines.append(f"{d.repo} ({d.revision or 'main'}): {len(d.files)} files, {gb(d.total)}; "
                     f"{len(d.present)} already here, {gb(d.missing_bytes)} to download")
        for f in d.files:
            mark = "here " if f.path in d.present else "     "
            where = f" -> {d.place[f.path]}" if f.path in d.place else ""
            lines.append(f"  {mark}{f.size / 1e9:9.3f} GB  {f.path}{where}")
    return lines


def sha256_of(path: Path, progress: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()


def verify(folder: Path, files: list[HubFile], out: Callable[[str], None]) -> None:
    """Each file's size, and each LFS file's sha256, against the hub's listing."""
    bad = []
    for f in files:
        local = folder / f.path
        if not local.is_file():
            bad.append(f"{f.path}: missing after the download")
            continue
        size = local.stat().st_size
        if size != f.size:
            bad.append(f"{f.path}: {size} bytes, the hub lists {f.size}")
            continue
        if f.sha256:
            out(f"checking {f.path} ({gb(f.size)}) against the hub's sha256 ...")
            got = sha256_of(local)
            if got != f.sha256:
                bad.append(f"{f.path}: sha256 {got[:16]}..., the hub lists {f.sha256[:16]}...")
    if bad:
        raise ModelSourceError("the download does not match the hub's listing: " + "; ".join(bad) +
                               "; delete those files from the Hugging Face cache and run imglora fetch again")


def run(hub: Hub, downloads: list[Download], out: Callable[[str], None] = print) -> None:
    """Download what is missing (resumable), check every file, and place single files."""
    for d in downloads:
        todo = [f.path for f in d.files if f.path not in d.present]
        if todo:
            out(f"downloading {len(todo)} files ({gb(d.missing_bytes)}) from {d.repo} ...")
        folder = _call(d.repo, hub.snapshot, d.repo, d.revision, [f.path for f in d.files])
        verify(folder, d.files, out)
        for path, dest in d.place.items():
            _place(folder / path, dest)
            out(f"placed {dest}")


def _place(src: Path, dest: Path) -> None:
    """The cached file at ``dest`` under a temporary name first, then renamed (a hard link where the
    cache is on the same file system, else a copy)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.imglora-tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src.resolve(), tmp)
    except OSError:
        shutil.copyfile(src.resolve(), tmp)
    os.replace(tmp, dest)

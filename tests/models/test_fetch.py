"""``imglora fetch``: the files a preset's run reads, planned from the hub's listing, downloaded,
checked and placed, with the hub client replaced by a fake (no network)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import importlib

import pytest
from click.testing import CliRunner
from huggingface_hub import errors as hub_errors

from comfy_tree import fake_comfyui

from imglora.models import fetch as hubfetch
from imglora.cli import main
from imglora.commands.fetch import fetch
from imglora.errors import ModelSourceError
from imglora.families import registry
from imglora.models.resolve import resolve_model

REPO = Path(__file__).resolve().parents[2]
# the HTTP library this huggingface_hub uses (httpx for 1.x, httpx2 for 2.x)
httpx = importlib.import_module(hub_errors.Response.__module__.split(".")[0])
PRESETS = REPO / "presets"

# A component's files in a hub repository as they come, each marked whether a run reads it.
SCHEDULER = [("scheduler_config.json", True)]
CLIP_TOKENIZER = [("vocab.json", True), ("merges.txt", True), ("tokenizer_config.json", True),
                  ("special_tokens_map.json", True)]
T5_TOKENIZER = [("spiece.model", True), ("tokenizer.json", True), ("tokenizer_config.json", True),
                ("special_tokens_map.json", True)]
ENCODER = [("config.json", True), ("model.safetensors", True), ("model.fp16.safetensors", False),
           ("flax_model.msgpack", False), ("pytorch_model.bin", False), ("model.onnx", False),
           ("openvino/openvino_model.xml", False)]
SHARDED_ENCODER = [("config.json", True), ("model.safetensors.index.json", True),
                   ("model-00001-of-00002.safetensors", True), ("model-00002-of-00002.safetensors", True)]
DENOISER = [("config.json", True), ("diffusion_pytorch_model.safetensors.index.json", True),
            ("diffusion_pytorch_model-00001-of-00002.safetensors", True),
            ("diffusion_pytorch_model-00002-of-00002.safetensors", True),
            ("diffusion_pytorch_model.safetensors.index.fp16.json", False),
            ("diffusion_pytorch_model.fp16-00001-of-00002.safetensors", False),
            ("diffusion_pytorch_model.fp16-00002-of-00002.safetensors", False)]
VAE = [("config.json", True), ("diffusion_pytorch_model.safetensors", True),
       ("diffusion_pytorch_model.fp16.safetensors", False), ("diffusion_pytorch_model.bin", False)]
PROCESSOR = [("preprocessor_config.json", True), ("chat_template.jinja", True)]
ROOT = [("model_index.json", True), ("README.md", False), (".gitattributes", False), ("LICENSE.md", False),
        ("flux1-dev.safetensors", False), ("ae.safetensors", False), ("vae_1_0/diffusion_pytorch_model.safetensors",
                                                                      False)]


def _for(component: str, cls: str) -> list[tuple[str, bool]]:
    if component.startswith("scheduler"):
        return SCHEDULER
    if component.startswith("tokenizer"):
        return T5_TOKENIZER if "T5" in cls else CLIP_TOKENIZER
    if component == "processor":
        return PROCESSOR
    if component.startswith("text_encoder"):
        return SHARDED_ENCODER if "T5" in cls or "Qwen" in cls else ENCODER
    if component in ("transformer", "unet"):
        return DENOISER
    return VAE


def diffusers_repo(model_index: dict) -> tuple[dict[str, bytes], set[str]]:
    """{path: content} of a repository shaped like the real ones, and the paths a run reads."""
    files: dict[str, bytes] = {}
    wanted: set[str] = set()
    for path, want in ROOT:
        files[path] = json.dumps(model_index).encode() if path == "model_index.json" else path.encode() * 3
        if want:
            wanted.add(path)
    for comp, entry in model_index.items():
        if comp not in hubfetch.components(model_index):
            continue
        for name, want in _for(comp, entry[1]):
            path = f"{comp}/{name}"
            files[path] = f"{path} content".encode() * (7 if name.endswith(".safetensors") else 1)
            if want:
                wanted.add(path)
    return files, wanted


def llm_repo() -> tuple[dict[str, bytes], set[str]]:
    table = [("config.json", True), ("generation_config.json", True), ("tokenizer.json", True),
             ("tokenizer_config.json", True), ("vocab.json", True), ("merges.txt", True),
             ("model.safetensors.index.json", True), ("model-00001-of-00004.safetensors", True),
             ("model-00004-of-00004.safetensors", True), ("README.md", False), ("LICENSE", False),
             ("original/consolidated.00.pth", False), ("original/params.json", False),
             ("pytorch_model-00001-of-00004.bin", False), ("model.gguf", False)]
    return {p: f"{p} content".encode() * 5 for p, _ in table}, {p for p, w in table if w}


class FakeHub(hubfetch.Hub):
    """The hub: listings with sizes and sha256 of real contents; a download writes the asked files
    into a snapshot folder (the cache), optionally failing part-way as a dropped connection does."""

    def __init__(self, repos: dict[str, dict[str, bytes]], cache: Path) -> None:
        self.repos, self.cache = repos, cache
        self.asked: list[tuple[str, list[str]]] = []
        self.fail_after: int | None = None
        self.gated: set[str] = set()
        self.corrupt: set[str] = set()

    def _check(self, repo: str) -> None:
        if repo in self.gated:
            raise hub_errors.GatedRepoError(
                "403 Client Error. Cannot access gated repo", response=httpx.Response(
                    403, request=httpx.Request("GET", f"https://huggingface.co/api/models/{repo}")))
        if repo not in self.repos:
            raise hub_errors.RepositoryNotFoundError(
                "404", response=httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/x")))

    def listing(self, repo, revision):
        self._check(repo)
        return "0123abc", [hubfetch.HubFile(p, len(c), hashlib.sha256(c).hexdigest() if p.endswith(
            ".safetensors") else None) for p, c in self.repos[repo].items()]

    def read_text(self, repo, path, revision):
        self._check(repo)
        return self.repos[repo][path].decode()

    def folder(self, repo: str) -> Path:
        return self.cache / repo.replace("/", "--") / "snapshots" / "0123abc"

    def cached(self, repo, path, revision):
        p = self.folder(repo) / path
        return p if p.is_file() else None

    def snapshot(self, repo, revision, paths):
        self._check(repo)
        self.asked.append((repo, list(paths)))
        for i, path in enumerate(paths):
            if self.fail_after is not None and i >= self.fail_after:
                raise httpx.ConnectError("Connection reset by peer")
            dest = self.folder(repo) / path
            if dest.is_file():  # huggingface_hub skips complete files
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            data = self.repos[repo][path]
            dest.write_bytes(data[:-1] + b"X" if path in self.corrupt else data)
        return self.folder(repo)


def _model_index(preset: str) -> dict:
    """The model_index.json of the preset's model as imglora ships it (the real model's)."""
    from imglora.commands.common import family_of, load_config

    family = family_of(load_config(PRESETS / preset))
    comps = hubfetch.shipped_components(family)
    folder = Path(__import__("inspect").getfile(type(family))).parent / "configs"
    for index in sorted(folder.glob("*/model_index.json")):
        data = json.loads(index.read_text())
        assert hubfetch.components(data) == comps
        return data
    raise AssertionError(preset)


HUB_PRESETS = {"flux.toml": "black-forest-labs/FLUX.1-dev", "flux-kontext.toml": "black-forest-labs/FLUX.1-Kontext-dev",
               "chroma.toml": "lodestones/Chroma1-HD", "qwen-image.toml": "Qwen/Qwen-Image",
               "qwen-image-edit.toml": "Qwen/Qwen-Image-Edit", "qwen-image-edit-plus.toml": "Qwen/Qwen-Image-Edit-2509",
               "sdxl.toml": "stabilityai/stable-diffusion-xl-base-1.0",
               "sdxl-datasets.toml": "stabilityai/stable-diffusion-xl-base-1.0",
               "sdxl-prodigy.toml": "stabilityai/stable-diffusion-xl-base-1.0", "qlora-llm.toml": "Qwen/Qwen2.5-7B-Instruct",
               "z-image.toml": "Tongyi-MAI/Z-Image-Turbo", "flux2-klein.toml": "black-forest-labs/FLUX.2-klein-base-4B",
               "flux2-dev.toml": "black-forest-labs/FLUX.2-dev", "qwen-image-2512.toml": "Qwen/Qwen-Image-2512",
               "krea2.toml": "krea/Krea-2-Raw", "qwen-image-2.1.toml": "Qwen/Qwen-Image-2.1"}


def test_every_shipped_preset_is_covered() -> None:
    tiny = {p.name for p in PRESETS.glob("tiny-*.toml")}
    assert {p.name for p in PRESETS.glob("*.toml")} - tiny == set(HUB_PRESETS) | {"flux-comfyui.toml",
                                                                                  "sdxl-civitai.toml"}


@pytest.mark.parametrize("preset", sorted(HUB_PRESETS))
def test_each_hub_preset_fetches_exactly_the_files_its_run_reads(preset, tmp_path) -> None:
    repo = HUB_PRESETS[preset]
    files, wanted = llm_repo() if preset == "qlora-llm.toml" else diffusers_repo(_model_index(preset))
    hub = FakeHub({repo: files}, tmp_path / "cache")
    lines: list[str] = []
    (d,) = fetch(str(PRESETS / preset), (), dry_run=True, hub=hub, out=lines.append)
    assert {f.path for f in d.files} == wanted
    assert d.total == sum(len(files[p]) for p in wanted) and not d.present and hub.asked == []
    assert lines[0] == f"{repo} (0123abc): {len(wanted)} files, {hubfetch.gb(d.total)}; 0 already here, " \
                       f"{hubfetch.gb(d.total)} to download"
    assert lines[-1] == f"dry run: {hubfetch.gb(d.total)} would be downloaded"
    # The error of a model not in the cache prints the same selection as hf download patterns.
    from imglora.commands.common import family_of, load_config

    cfg = load_config(PRESETS / preset)
    with pytest.raises(ModelSourceError) as err:
        resolve_model(cfg.model, family_of(cfg))
    msg = str(err.value)
    assert "imglora fetch PRESET" in msg and f"hf download {repo} --include " in msg
    include, exclude = hubfetch.patterns(family_of(cfg).model_marker, hubfetch.shipped_components(family_of(cfg)))
    assert {p for p in files if hubfetch.matches(p, include, exclude)} == wanted
    assert all(f"'{p}'" in msg or f" {p} " in msg for p in include + exclude)


def test_a_download_is_checked_resumes_after_a_dropped_connection_and_keeps_what_is_there(tmp_path) -> None:
    repo = "black-forest-labs/FLUX.1-dev"
    files, wanted = diffusers_repo(_model_index("flux.toml"))
    hub = FakeHub({repo: files}, tmp_path / "cache")
    hub.fail_after = 5
    with pytest.raises(ModelSourceError, match=r"black-forest-labs/FLUX.1-dev: the hub could not be reached or "
                                                r"refused \(ConnectError: Connection reset by peer\).*resumes"):
        fetch(str(PRESETS / "flux.toml"), (), hub=hub, out=lambda s: None)
    hub.fail_after = None
    lines: list[str] = []
    (d,) = fetch(str(PRESETS / "flux.toml"), (), hub=hub, out=lines.append)
    assert len(d.present) == 5 and d.missing_bytes == d.total - sum(len(files[p]) for p in d.present)
    assert sorted(hub.asked[-1][1]) == sorted(wanted)  # the whole list; the client skips complete files
    assert sum(1 for line in lines if line.startswith("  here ")) == 5
    assert f"downloading {len(wanted) - 5} files" in "\n".join(lines)
    assert lines[-1].startswith("done: model.path = 'black-forest-labs/FLUX.1-dev' now loads from the Hugging Face "
                                "cache; every file's size and sha256 checked")
    n_weights = sum(1 for p in wanted if p.endswith(".safetensors"))
    assert sum(1 for line in lines if line.startswith("checking ")) == n_weights
    # a third run finds everything here
    (d,) = fetch(str(PRESETS / "flux.toml"), (), dry_run=True, hub=hub, out=lambda s: None)
    assert d.present == wanted and d.missing_bytes == 0


def test_a_file_that_does_not_match_the_hub_s_sha256_is_named(tmp_path) -> None:
    repo = "black-forest-labs/FLUX.1-dev"
    files, _ = diffusers_repo(_model_index("flux.toml"))
    hub = FakeHub({repo: files}, tmp_path / "cache")
    hub.corrupt = {"vae/diffusion_pytorch_model.safetensors"}
    with pytest.raises(ModelSourceError, match=r"does not match the hub's listing: vae/diffusion_pytorch_model."
                                                r"safetensors: sha256 [0-9a-f]{16}\.\.\., the hub lists"):
        fetch(str(PRESETS / "flux.toml"), (), hub=hub, out=lambda s: None)


def test_a_gated_model_gets_its_licence_page_and_hf_auth_login(tmp_path) -> None:
    repo = "black-forest-labs/FLUX.1-dev"
    files, _ = diffusers_repo(_model_index("flux.toml"))
    hub = FakeHub({repo: files}, tmp_path / "cache")
    hub.gated = {repo}
    with pytest.raises(ModelSourceError) as err:
        fetch(str(PRESETS / "flux.toml"), (), hub=hub, out=lambda s: None)
    msg = str(err.value)
    assert msg.startswith("black-forest-labs/FLUX.1-dev is gated: accept its licence at "
                          "https://huggingface.co/black-forest-labs/FLUX.1-dev") and "`hf auth login`" in msg
    hub.gated, hub.repos = set(), {}
    with pytest.raises(ModelSourceError, match="no such repository on the Hugging Face hub"):
        fetch(str(PRESETS / "flux.toml"), (), hub=hub, out=lambda s: None)


def test_weights_only_as_pickles_are_refused(tmp_path) -> None:
    repo = "black-forest-labs/FLUX.1-dev"
    files, _ = diffusers_repo(_model_index("flux.toml"))
    files = {p: c for p, c in files.items() if not (p.startswith("vae/") and p.endswith(".safetensors"))}
    hub = FakeHub({repo: files}, tmp_path / "cache")
    with pytest.raises(ModelSourceError, match=r"vae/diffusion_pytorch_model.bin -- the weights of vae/ are only a "
                                                r"pickle \(.bin\), which imglora never loads"):
        fetch(str(PRESETS / "flux.toml"), (), dry_run=True, hub=hub, out=lambda s: None)


def _fake_comfyui(root: Path) -> Path:
    return fake_comfyui(root, "text_encoders", "checkpoints")


def test_single_files_are_placed_in_their_comfyui_folders(tmp_path) -> None:
    comfy = _fake_comfyui(tmp_path / "ComfyUI")
    (comfy / "models" / "text_encoders" / "clip_l.safetensors").write_bytes(b"already here")
    bfl = {"flux1-dev.safetensors": b"transformer" * 9, "ae.safetensors": b"vae" * 5, "model_index.json": b"{}"}
    te = {"clip_l.safetensors": b"clip" * 3, "t5xxl_fp16.safetensors": b"t5" * 11}
    hub = FakeHub({"black-forest-labs/FLUX.1-dev": bfl, "comfyanonymous/flux_text_encoders": te}, tmp_path / "cache")
    lines: list[str] = []
    downloads = fetch(str(PRESETS / "flux-comfyui.toml"), (f'model.comfyui="{comfy}"',), hub=hub, out=lines.append)
    assert {(d.repo, f.path) for d in downloads for f in d.files} == {
        ("black-forest-labs/FLUX.1-dev", "flux1-dev.safetensors"), ("black-forest-labs/FLUX.1-dev", "ae.safetensors"),
        ("comfyanonymous/flux_text_encoders", "t5xxl_fp16.safetensors")}  # clip_l was there
    placed = {comfy / "models/diffusion_models/flux1-dev.safetensors": bfl["flux1-dev.safetensors"],
              comfy / "models/vae/ae.safetensors": bfl["ae.safetensors"],
              comfy / "models/text_encoders/t5xxl_fp16.safetensors": te["t5xxl_fp16.safetensors"]}
    for path, data in placed.items():
        assert path.read_bytes() == data and f"placed {path}" in lines
    assert (comfy / "models/text_encoders/clip_l.safetensors").read_bytes() == b"already here"
    assert not list(comfy.rglob(".*imglora-tmp"))
    assert fetch(str(PRESETS / "flux-comfyui.toml"), (f'model.comfyui="{comfy}"',), hub=hub, out=lines.append) == []
    assert lines[-1] == "every file the preset names is already here; nothing to fetch"


def test_an_unknown_single_file_name_says_where_to_put_it(tmp_path) -> None:
    comfy = _fake_comfyui(tmp_path / "ComfyUI")
    hub = FakeHub({}, tmp_path / "cache")
    with pytest.raises(ModelSourceError, match=r"model.path = 'my_finetune.safetensors': imglora does not know where "
                                                r"this file is published; download it yourself into"):
        fetch(str(PRESETS / "flux-comfyui.toml"), (f'model.comfyui="{comfy}"', 'model.path="my_finetune.safetensors"'),
              hub=hub, out=lambda s: None)
    with pytest.raises(ModelSourceError, match=r"model.path = .*illustriousXL_v01.safetensors.*no such file. imglora "
                                                r"fetch places known single files by their bare names"):
        fetch(str(PRESETS / "sdxl-civitai.toml"), (), hub=hub, out=lambda s: None)


def test_cli_tiny_and_local_models_need_nothing(tmp_path) -> None:
    r = CliRunner().invoke(main, ["fetch", str(PRESETS / "tiny-flux.toml")])
    assert r.exit_code == 0 and "a tiny model imglora builds on this machine; nothing to fetch" in r.output
    r = CliRunner().invoke(main, ["fetch", str(PRESETS / "flux.toml"), "--set", f'model.path="{tmp_path}"'])
    assert r.exit_code == 0 and "is a local folder; nothing to fetch" in r.output
    r = CliRunner().invoke(main, ["fetch", "--help"])
    assert r.exit_code == 0 and "--dry-run" in r.output and "hf auth login" in r.output


def test_offline_the_cli_says_so_in_one_line(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    r = CliRunner().invoke(main, ["fetch", str(PRESETS / "flux.toml"), "--dry-run"])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "black-forest-labs/FLUX.1-dev: HF_HUB_OFFLINE is set, so nothing can be fetched" in r.output


def test_registry_families_all_have_a_selection() -> None:
    for name in registry.names():
        family = registry.get(name)
        include, exclude = hubfetch.patterns(family.model_marker, hubfetch.shipped_components(family))
        assert include and exclude
        if family.model_marker == "model_index.json":
            assert hubfetch.shipped_components(family), name


def test_the_families_published_files_are_well_formed() -> None:
    from imglora.models.comfyui import DEFAULT_FOLDERS

    seen = 0
    for name in registry.names():
        for file, (repo, path, kind) in getattr(registry.get(name), "published_files", {}).items():
            seen += 1
            assert file.endswith(".safetensors") and Path(path).name == file, (name, file)
            assert hubfetch.looks_like_repo(repo) and kind in DEFAULT_FOLDERS, (name, file)
    assert seen >= 8
    # the ComfyUI presets' names are all known to their family
    from imglora.commands.common import family_of, load_config

    cfg = load_config(PRESETS / "flux-comfyui.toml")
    known = family_of(cfg).published_files
    assert {cfg.model.path, cfg.model.vae, cfg.model.text_encoder, cfg.model.text_encoder_2} <= set(known)

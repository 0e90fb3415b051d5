"""``imglora fetch`` through huggingface_hub itself, with only its HTTP transport replaced: the hub's
listing (``model_info`` with file metadata), ``hf_hub_download``, ``snapshot_download`` and the cache
lookups run as they do against huggingface.co, answered by a mock transport serving a small
repository (no network: every request goes to the handler below)."""

from __future__ import annotations

import hashlib
import importlib
import json
import re

import pytest
from huggingface_hub import constants
from huggingface_hub import errors as hub_errors
from huggingface_hub.utils import _http

from imglora.models import fetch as hubfetch
from imglora.errors import ModelSourceError
from imglora.families import registry

httpx = importlib.import_module(hub_errors.Response.__module__.split(".")[0])

REPO = "someone/tiny-flux-repo"
SHA = "0123456789abcdef0123456789abcdef01234567"
INDEX = {"_class_name": "FluxPipeline", "vae": ["diffusers", "AutoencoderKL"], "scheduler": [
    "diffusers", "FlowMatchEulerDiscreteScheduler"], "tokenizer": [None, None]}
FILES = {
    "model_index.json": json.dumps(INDEX).encode(),
    "scheduler/scheduler_config.json": b'{"shift": 3.0}',
    "vae/config.json": b'{"latent_channels": 16}',
    "vae/diffusion_pytorch_model.safetensors": b"vae weights " * 400,
    "vae/diffusion_pytorch_model.fp16.safetensors": b"half " * 300,
    "flux1-dev.safetensors": b"single file " * 500,
    "README.md": b"# a model",
}


def _etag(path: str, content: bytes) -> str:
    return hashlib.sha256(content).hexdigest() if path.endswith(".safetensors") else hashlib.sha1(content).hexdigest()


class Server:
    """What the handler serves and what it was asked."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.gated = False

    def handle(self, request):
        path = request.url.path
        self.requests.append(f"{request.method} {path}")
        if self.gated:
            return httpx.Response(403, headers={"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model "
                                                f"{REPO} is restricted."}, request=request)
        if re.fullmatch(rf"/api/models/{REPO}(/revision/[^/]+)?", path):
            siblings = [{"rfilename": p, "size": len(c), "blobId": hashlib.sha1(c).hexdigest(),
                         **({"lfs": {"size": len(c), "sha256": _etag(p, c), "pointerSize": 134}}
                            if p.endswith(".safetensors") else {})} for p, c in FILES.items()]
            return httpx.Response(200, json={"id": REPO, "modelId": REPO, "sha": SHA, "private": False,
                                             "gated": False, "siblings": siblings}, request=request)
        if re.fullmatch(rf"/api/models/{REPO}/tree/[^/]+(/.*)?", path):  # snapshot_download's file list
            return httpx.Response(200, json=[{"type": "file", "path": p, "size": len(c), "oid": hashlib.sha1(c).hexdigest(),
                                              **({"lfs": {"size": len(c), "oid": _etag(p, c), "pointerSize": 134}}
                                                 if p.endswith(".safetensors") else {})} for p, c in FILES.items()],
                                  request=request)
        m = re.fullmatch(rf"/{REPO}/resolve/([^/]+)/(.+)", path)
        if m and m.group(2) in FILES:
            content = FILES[m.group(2)]
            headers = {"X-Repo-Commit": SHA, "ETag": f'"{_etag(m.group(2), content)}"',
                       "Content-Length": str(len(content))}
            if request.method == "HEAD":
                return httpx.Response(200, headers=headers, request=request)
            start = int(re.match(r"bytes=(\d+)-", request.headers.get("Range", "bytes=0-")).group(1))
            body = content[start:]
            headers["Content-Length"] = str(len(body))
            return httpx.Response(206 if start else 200, headers=headers, content=body, request=request)
        return httpx.Response(404, headers={"X-Error-Code": "EntryNotFound"}, request=request)


@pytest.fixture()
def hub_server(tmp_path, monkeypatch):
    server = Server()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    _http.set_client_factory(lambda: httpx.Client(transport=httpx.MockTransport(server.handle), follow_redirects=True))
    yield server
    _http.set_client_factory(_http.default_client_factory)


def test_the_real_client_lists_downloads_and_checks_exactly_the_run_s_files(hub_server, tmp_path) -> None:
    family = registry.get("flux")
    hub = hubfetch.Hub()
    d = hubfetch.plan_repo(hub, REPO, family)
    assert d.revision == SHA
    assert [f.path for f in d.files] == ["model_index.json", "scheduler/scheduler_config.json", "vae/config.json",
                                         "vae/diffusion_pytorch_model.safetensors"]
    weights = d.files[-1]
    assert weights.size == len(FILES[weights.path]) and weights.sha256 == _etag(weights.path, FILES[weights.path])
    assert d.present == {"model_index.json"}  # read (through the cache) to learn the components
    lines: list[str] = []
    hubfetch.run(hub, [d], lines.append)
    assert lines == ["downloading 3 files (0.00 GB) from someone/tiny-flux-repo ...",
                     "checking vae/diffusion_pytorch_model.safetensors (0.00 GB) against the hub's sha256 ..."]
    got = [r.split(" ", 1)[1] for r in hub_server.requests if "/resolve/" in r and r.startswith("GET")]
    assert sorted(p.rsplit("/", 1)[-1] for p in got) == ["config.json", "diffusion_pytorch_model.safetensors",
                                                         "model_index.json", "scheduler_config.json"]
    assert not any("fp16" in r or "flux1-dev" in r or "README" in r for r in hub_server.requests)
    # in the Hugging Face cache, where a run's model.path finds them; a second plan finds them there
    again = hubfetch.plan_repo(hub, REPO, family)
    assert again.present == {f.path for f in d.files} and again.missing_bytes == 0


def test_the_real_client_s_gated_answer_becomes_one_message(hub_server) -> None:
    hub_server.gated = True
    with pytest.raises(ModelSourceError, match=rf"{REPO} is gated: accept its licence at https://huggingface.co/"
                                                rf"{REPO} while logged in, then run `hf auth login`"):
        hubfetch.plan_repo(hubfetch.Hub(), REPO, registry.get("flux"))

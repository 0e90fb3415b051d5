"""Run records: what ran, where, on what, and how long each phase took.

Every command that does work writes ``<run dir>/records/<UTC time>-<command>.json`` with library
versions, the device, host RAM, the resolved config, model weight checksums, the dataset version
and the duration of each phase. Checksums of multi-GB weight files are computed once and
remembered by (path, size, mtime) in ``<imglora home>/checksums.json``.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import subprocess
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

from ..util import atomic
from ..util.hashing import sha256_file
from ..util.version import __version__
from ..util.home import imglora_home

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt")
PACKAGES = ("torch", "diffusers", "transformers", "peft", "accelerate", "optimum-quanto", "safetensors")


def cached_sha256(path: str | Path) -> str:
    """sha256 of a file, remembered by (real path, size, mtime) so big weights are hashed once."""
    path = Path(path).resolve()
    if path.parent.name == "blobs" and len(path.name) == 64 and all(c in "0123456789abcdef" for c in path.name):
        # A Hugging Face cache blob of an LFS file is named by the sha256 of its content: no need to
        # read tens of GB on a fresh rented machine.
        return path.name
    st = path.stat()
    memo_file = imglora_home() / "checksums.json"
    try:
        memo = json.loads(memo_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        memo = {}
    key = str(path)
    entry = memo.get(key)
    if entry and entry["size"] == st.st_size and entry["mtime_ns"] == st.st_mtime_ns:
        return entry["sha256"]
    digest = sha256_file(path)
    memo[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    atomic.write_json(memo_file, memo)
    return digest


def folder_checksums(folder: Path, weights_only: bool = True) -> dict[str, str]:
    """{relative path: sha256} of a model folder's weight files (or every file)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and (not weights_only or p.suffix in WEIGHT_SUFFIXES):
            out[p.relative_to(folder).as_posix()] = cached_sha256(p)
    return out


def identity(paths: list[Path]) -> str:
    """One hash naming the exact contents of some model components: every file of each folder
    (configs included) and each single weight file, in order. A single file enters by content alone
    (its sha256, remembered per file), so renaming or moving it keeps the key; another file changes it."""
    h = hashlib.sha256()
    for path in paths:
        if Path(path).is_file():
            h.update(f"file={cached_sha256(path)}\n".encode())
            continue
        for rel, digest in folder_checksums(path, weights_only=False).items():
            h.update(f"{path.name}/{rel}={digest}\n".encode())
    return h.hexdigest()


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"imglora": __version__, "python": platform.python_version(),
                           "platform": platform.platform()}
    for pkg in PACKAGES:
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            env[pkg] = None
    try:
        import psutil

        env["host_ram_bytes"] = psutil.virtual_memory().total
    except ImportError:
        env["host_ram_bytes"] = None
    env.update(device_info())
    return env


def device_info() -> dict[str, Any]:
    import torch

    from ..util.devices import cuda_available

    if not cuda_available():
        return {"device": "cpu", "device_name": platform.processor() or platform.machine(),
                "cpu_threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(0)
    return {"device": "cuda", "device_name": props.name, "device_memory_bytes": props.total_memory,
            "device_count": torch.cuda.device_count(), "cuda": torch.version.cuda,
            "driver": _nvidia_driver()}


def _nvidia_driver() -> str | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


class RunRecord:
    """Collects phases and facts for one command; ``write`` puts them in the run folder."""

    def __init__(self, command: str, run_dir: Path, config: dict[str, Any] | None = None):
        self.command = command
        self.run_dir = Path(run_dir)
        self.started = datetime.now(timezone.utc)
        self.data: dict[str, Any] = {"command": command, "started": self.started.isoformat(),
                                     "environment": environment(), "config": config, "phases": {}}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.data["phases"][name] = round(self.data["phases"].get(name, 0.0) + time.perf_counter() - t0, 4)

    def set(self, **facts: Any) -> None:
        self.data.update(facts)

    def write(self, status: str = "ok") -> Path:
        self.data["status"] = status
        self.data["finished"] = datetime.now(timezone.utc).isoformat()
        stamp = self.started.strftime("%Y%m%dT%H%M%S.%fZ")
        path = self.run_dir / "records" / f"{stamp}-{self.command}.json"
        atomic.write_json(path, self.data)
        return path


def read_records(run_dir: Path, command: str | None = None) -> list[dict[str, Any]]:
    """Records of a run folder, oldest first."""
    out = []
    for p in sorted((Path(run_dir) / "records").glob("*.json")):
        rec = json.loads(p.read_text())
        if command is None or rec.get("command") == command:
            out.append(rec)
    return out

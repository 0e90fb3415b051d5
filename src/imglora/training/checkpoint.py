"""Checkpoints: everything needed to continue a run bit for bit, written atomically.

``<run>/checkpoints/step-000020/`` holds the adapter (diffusers layout, safetensors), the
optimizer state (tensors in safetensors, structure in JSON), the scheduler state, RNG states,
the step and the resolved config with its hash; with ``train.ema`` the moving average
(``adapter_ema/``), with a schedule-free optimizer the weights it steps (``train_params.safetensors``:
the adapter holds its averaged weights). The folder is built under a temporary name and renamed
into place, so a crash never leaves a checkpoint that looks complete but is not; only then are
checkpoints beyond ``keep`` removed, oldest first (never one newer than the new one).

Every file's sha256 and size are written last, into ``sha256.json`` (atomically), and checked
before a checkpoint is trusted: a file changed since (flipped bits, a truncated copy) makes the
checkpoint damaged, and ``--resume`` takes the one before. A checkpoint written before checksums
existed is still resumed, with a warning that it cannot be verified; its safetensors files are
still checked to be whole (header and length), which catches a truncated file but not changed bits.
A pruned checkpoint is first renamed out of sight and then removed, so a reader (``imglora eval``
while the run trains) sees it whole or not at all.

The loop reseeds every update from (seed, update) and the data order is a function of (seed,
epoch), so resuming needs neither RNG nor iterator state; the RNG states are saved for inspection.
The dataset version and the run's length are saved so a resume over changed data is refused.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..util.owned import load_file

from ..util import atomic
from ..errors import ImgloraError
from ..util.hashing import sha256_file

if TYPE_CHECKING:
    from ..config import Config

EMA_DIR = "adapter_ema"  # beside adapter/, in the run folder and in each checkpoint
TRAIN_PARAMS = "train_params.safetensors"
MANIFEST = "sha256.json"  # every other file's sha256 and size, written last


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:06d}"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    root = Path(run_dir) / "checkpoints"
    out = []
    for p in root.glob("step-*"):
        if p.is_dir() and (p / "state.json").is_file() and p.name[5:].isdigit():
            out.append((int(p.name[5:]), p))
    return sorted(out)


TENSOR = "__tensor__"  # in the optimizer JSON: {"__tensor__": key} stands for a tensor of optimizer.safetensors


def optimizer_to_tensors(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer ``state_dict`` as (tensors for safetensors, the rest for JSON), at any depth:
    nested state (bitsandbytes keeps its 8-bit state in a dict per parameter) and tensors in the
    param groups included. Each tensor is replaced by ``{"__tensor__": key}``; the state's integer
    keys become strings (JSON), and are turned back by :func:`optimizer_from_tensors`."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, key: str) -> Any:
        if torch.is_tensor(value):
            tensors[key] = value.detach().cpu().contiguous()
            return {TENSOR: key}
        if isinstance(value, dict):
            return {str(k): walk(v, f"{key}/{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{key}/{i}") for i, v in enumerate(value)]
        return value

    rest = {"format": 2, "state": walk(state["state"], "state"), "param_groups": walk(state["param_groups"], "group")}
    return tensors, rest


def optimizer_from_tensors(tensors: dict[str, torch.Tensor], rest: dict[str, Any]) -> dict[str, Any]:
    if rest.get("format") != 2:  # written before nested state: "<index>/<name>" tensors, the rest flat
        state: dict[int, dict[str, Any]] = {int(k): dict(v) for k, v in rest["state"].items()}
        for key, value in tensors.items():
            idx, name = key.split("/", 1)
            state.setdefault(int(idx), {})[name] = value
        return {"state": state, "param_groups": rest["param_groups"]}

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {TENSOR}:
                return tensors[value[TENSOR]]
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return {"state": {int(k): walk(v) for k, v in rest["state"].items()}, "param_groups": walk(rest["param_groups"])}


def save(run_dir: Path, step: int, *, write_weights, optimizer: torch.optim.Optimizer, scheduler: Any,
         config: dict[str, Any], config_hash: str, extra: dict[str, Any], keep: int) -> Path:
    """``write_weights(folder)`` writes the weights into the new checkpoint's folder: ``adapter/``,
    and where the run has them ``adapter_ema/`` and ``train_params.safetensors`` (see :func:`load`)."""
    dest = step_dir(run_dir, step)
    with atomic.atomic_dir(dest) as tmp:
        write_weights(tmp)
        tensors, rest = optimizer_to_tensors(optimizer.state_dict())
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                rng[f"cuda{i}"] = s
        save_file(rng, str(tmp / "rng.safetensors"))
        (tmp / "state.json").write_text(json.dumps({
            "step": step, "config_hash": config_hash, "config": config, "optimizer": rest,
            "scheduler": scheduler.state_dict(), "python_random": _py_rng(), **extra,
        }, indent=1, default=_json_default))
        write_manifest(tmp)  # last: it vouches for every file above
    # Only checkpoints older than the one just written are ever pruned.
    older = [p for s, p in list_checkpoints(run_dir) if s <= step]
    for old in older[:-keep]:
        remove(old)
    return dest


def remove(path: Path) -> None:
    """Delete a checkpoint folder so that no reader sees it half removed: one rename takes it out
    of ``list_checkpoints`` (to a temporary name that :func:`atomic.recover` tidies if this process
    dies), then its files go."""
    try:
        hidden = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        os.replace(path, hidden)
    except OSError:  # e.g. gone already
        hidden = path
    shutil.rmtree(hidden, ignore_errors=True)


def write_manifest(folder: Path) -> None:
    """``sha256.json``: the sha256 and size of every file in ``folder`` (a checkpoint being built)."""
    files = {p.relative_to(folder).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}
    atomic.write_json(folder / MANIFEST, {"format": 1, "files": files})


def verify(path: Path) -> bool:
    """Check a checkpoint's files against its ``sha256.json``; raises :class:`DamagedCheckpoint`
    naming the first file that differs. Returns False for a checkpoint written before checksums
    (nothing to check against); every safetensors file is then only checked to be whole."""
    manifest = path / MANIFEST
    if manifest.is_file():
        try:
            files = json.loads(manifest.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DamagedCheckpoint(f"{manifest} cannot be read ({exc})") from None
        for rel, want in files.items():
            _check_file(path, rel, want)
        return True
    for p in sorted(path.rglob("*.safetensors")):
        try:
            with safe_open(str(p), "pt"):
                pass
        except (OSError, SafetensorError) as exc:
            raise DamagedCheckpoint(f"{p} is not a whole safetensors file ({exc})") from None
    return False


def _check_file(path: Path, rel: str, want: dict[str, Any]) -> None:
    file = path / rel
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{file} is missing (listed in {MANIFEST})") from None
    if size != want["bytes"]:
        raise DamagedCheckpoint(f"{file} is {size:,} bytes, {want['bytes']:,} when the checkpoint was written "
                                "(truncated or overwritten)")
    if sha256_file(file) != want["sha256"]:
        raise DamagedCheckpoint(f"{file} does not match its sha256 in {MANIFEST}: its content changed since the "
                                "checkpoint was written (damaged on disk or in a copy)")


def _py_rng() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _json_default(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


class DamagedCheckpoint(ImgloraError):
    """A checkpoint file differs from what was written (checksum, size) or is not whole."""


UNREADABLE = (OSError, ValueError, KeyError, SafetensorError, DamagedCheckpoint)  # a damaged checkpoint on load


def damage(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed, or None when it can."""
    try:
        load(path)
    except UNREADABLE as exc:
        return str(exc)
    return None


def load(path: Path) -> dict[str, Any]:
    """A checkpoint's state, once its files are verified (``state["verified"]``: False for one
    written before checksums, which could only be checked to be whole)."""
    verified = verify(path)
    state = json.loads((path / "state.json").read_text())
    state["verified"] = verified
    state["optimizer_state"] = optimizer_from_tensors(load_file(str(path / "optimizer.safetensors")),
                                                      state.pop("optimizer"))
    state["rng"] = load_file(str(path / "rng.safetensors"))
    state["adapter_dir"] = path / "adapter"  # the weights to use (schedule-free: its averaged, eval-mode weights)
    state["ema_dir"] = path / EMA_DIR if (path / EMA_DIR).is_dir() else None  # train.ema's moving average
    # the weights the optimizer steps, when they are not the adapter's (schedule-free optimizers)
    state["train_params"] = load_file(str(path / TRAIN_PARAMS)) if (path / TRAIN_PARAMS).is_file() else None
    return state


def config_differences(old: dict[str, Any], new: "Config", families: Any) -> list[str]:
    """Dotted keys whose values differ and that change what is trained (fields not marked
    ``resume_safe``). ``old`` is a checkpoint's saved config, of any schema version: it is migrated
    first, so a checkpoint written before a key moved compares equal when nothing changed."""
    from ..config import ConfigError, from_dict, resume_safe_keys

    try:
        old = from_dict(old, families, source="checkpoint").to_dict()
    except ConfigError:
        pass  # compare as saved: every difference is then reported
    safe = resume_safe_keys(new)
    flat_old, flat_new = _flatten(old), _flatten(new.to_dict())
    diffs = []
    for key in sorted(set(flat_old) | set(flat_new)):
        if re.sub(r"\[\d+\]", "[]", key) in safe:  # data.sets[1].dir is safe as data.sets[].dir
            continue
        a, b = flat_old.get(key, "<absent>"), flat_new.get(key, "<absent>")
        if a != b:
            diffs.append(f"{key}: {json.dumps(a)} in the checkpoint, {json.dumps(b)} now")
    return diffs


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):  # [[data.sets]]
            for i, x in enumerate(v):
                out.update(_flatten(x, f"{prefix}{k}[{i}]."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class ResumeRefused(ImgloraError):
    pass

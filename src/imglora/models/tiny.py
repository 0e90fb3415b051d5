"""Tiny random models for tests, demos and dry runs: ``model.path = "tiny:<family>"``.

Each family builds its tiny model in exactly the on-disk layout of the real model it stands in for
(``Family.build_tiny``), so the real loading code runs on it unchanged. The weights are random, so
outputs are noise: these models exercise shapes, key names, loading, saving, caching and memory
plumbing in seconds on a CPU, never image or text quality. No network is needed: weights come from
``torch.manual_seed`` and tokenizers are built from built-in word lists. Builds are deterministic
(same seed, byte-identical files), take a few seconds and a few MB.

``ensure_tiny(family)`` builds once into ``$IMGLORA_HOME/tiny/<name>-v<TINY_VERSION>`` (default
``~/.cache/imglora``); bump ``TINY_VERSION`` whenever a generator changes so stale folders are
never reused.
"""

from __future__ import annotations

import json
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..util.atomic import atomic_dir
from ..util.home import imglora_home

if TYPE_CHECKING:
    from ..family import Family

TINY_VERSION = 1

# Written last into a finished build; a folder without a matching one is never trusted.
MARKER = "imglora_tiny.json"


def tiny_dir(name: str, root: Path | None = None) -> Path:
    """The folder ``ensure_tiny`` builds family ``name``'s model into: ``<root or home>/tiny/<name>-v<N>``."""
    return Path(root if root is not None else imglora_home()) / "tiny" / f"{name}-v{TINY_VERSION}"


def ensure_tiny(family: "Family", root: Path | None = None) -> Path:
    """Return the folder of ``family``'s tiny model, building it on first use.

    The build goes to a temporary folder that is renamed into place only once complete, so a crash
    never leaves a folder that a later call trusts. Builders are serialized by a lock file, so a
    process that loses the race waits and then finds the finished folder.
    """
    dest = tiny_dir(family.name, root)
    if _is_complete(dest, family.name):
        return dest
    with _lock(dest.with_name(f".{dest.name}.lock")):
        if not _is_complete(dest, family.name):
            with atomic_dir(dest) as tmp:
                build_tiny(family, tmp)
    return dest


def build_tiny(family: "Family", dest: Path, seed: int = 0) -> None:
    """Write ``family``'s tiny model into ``dest`` (created if needed), weights drawn from ``seed``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    family.build_tiny(dest, seed)
    write_json(dest / MARKER, {"kind": family.name, "version": TINY_VERSION, "seed": seed})


def _is_complete(folder: Path, name: str) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker.get("kind") == name and marker.get("version") == TINY_VERSION


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path``, held for the ``with`` block (waits for it)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def seeded(seed: int, component: str, make: Callable[[], Any]) -> Any:
    """Construct one component from its own seed, so components never share weights by accident
    and adding one does not change the others."""
    import torch

    torch.manual_seed(seed * 1_000_003 + zlib.crc32(component.encode()))
    return make()


def save_model(model: Any, folder: Path) -> None:
    model.save_pretrained(folder, safe_serialization=True)


def _fill(name: str, p: Any, generator: Any = None) -> None:
    """The random-weight rule of the benchmark models: a normalization's scale at one, biases at
    zero, every matrix N(0, 0.02) -- the modulation layers inside FLUX's adaptive norms
    (``norm1.linear``, ``norm.linear``, ``norm_out.linear``) included. Those are matrices named under
    a norm; at one, every shift, scale and gate came out near 86 at FLUX.1's width and a random
    model's losses meant nothing; N(0, 0.02) gives small modulation, as a trained model's is."""
    if "norm" in name and name.endswith("weight") and p.ndim == 1:
        p.fill_(1.0)
    elif name.endswith("bias"):
        p.zero_()
    else:
        p.normal_(0.0, 0.02, generator=generator)


def random_init(model: Any, dtype: Any, seed: int = 1) -> Any:
    """Materialise a model built on the meta device with small random weights (norms at one): the
    full-size architectures that benchmarks run before any weights are downloaded. The values come
    from one generator seeded with ``seed``: every process that builds the model gets the same
    weights (bench-swap runs each setting in a process of its own and compares their losses). Not 0:
    the synthetic batches draw from generators seeded 0, and a weight row equal to the data's first
    draws gave one modulation output of 9.4 where the others were near 0.1."""
    import torch

    model = model.to_empty(device="cpu").to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            _fill(name, p, generator)
    return model


def random_init_parts(model: Any, dtype: Any, device: Any, parts: "list[str]",
                      on_part: "Callable[[str, Any], None] | None" = None, seed: int = 1) -> Any:
    """Materialise a meta-device model on ``device`` piece by piece, frozen, in ``dtype``.

    First everything outside ``parts`` (module names such as ``"transformer_blocks.3"``), then each
    part in order, handed to ``on_part(name, module)`` as soon as it is filled (to quantize it, or
    move it to the host when it will be swapped) before the next one is made: ``device`` then holds
    what ``on_part`` leaves there plus one part, never the whole model in ``dtype``. The values
    follow :func:`random_init`'s rule, drawn from one generator on ``device`` seeded with ``seed`` (not
    0, as for random_init: bench-swap draws the first update's noise from a generator on the same
    device seeded 0, which would repeat the first weights drawn),
    so a build is deterministic on a given kind of device (its values differ from random_init's).
    Parameters are made directly in ``dtype`` (random_init goes through float32 on the host).
    Base weights come out frozen (``requires_grad`` False), which quantization needs.
    """
    import torch

    model.requires_grad_(False)
    model.to(dtype)  # on the meta device: only the recorded dtype changes
    modules = {name: model.get_submodule(name) for name in parts}
    inside = {id(m) for part in modules.values() for m in part.modules()}
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if id(mod) in inside:
                continue
            mod.to_empty(device=device, recurse=False)
            for pname, p in mod.named_parameters(recurse=False):
                _fill(f"{name}.{pname}" if name else pname, p, generator)
        for name, part in modules.items():
            part.to_empty(device=device)
            for pname, p in part.named_parameters():
                _fill(f"{name}.{pname}", p, generator)
            if on_part is not None:
                on_part(name, part)
    return model

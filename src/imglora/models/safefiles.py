"""Opening single weights files safely, reading tensors in the wanted dtype, and checking key sets.

Shared by every single-file loader (``families/*/singlefile.py``), so that each refuses the same things with the same words:
pickles (which run code when loaded), truncated or foreign files, and weights that do not fill the
model exactly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelSourceError
from ..util.owned import copy, own_module, unaligned_reads

PathLike = str | os.PathLike
log = logging.getLogger(__name__)

# Every extension ComfyUI accepts for weights (folder_paths.supported_pt_extensions) except ours.
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pt2")
FP8_DTYPES = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                    "float8_e5m2fnuz") if hasattr(torch, n))
# Quantization side keys: <layer>.scale_weight (ComfyUI's legacy scaled fp8) and <layer>.weight_scale
# (its newer mixed-precision format) multiply the fp8 weight; the others only describe it.
SCALE_SUFFIXES = ("scale_weight", "weight_scale")
SIDE_KEY_SUFFIXES = (".scale_weight", ".weight_scale", ".weight_scale_2", ".scale_input", ".input_scale",
                     ".comfy_quant")
SIDE_KEYS = ("scaled_fp8",)


def is_side_key(key: str) -> bool:
    """A quantization side key (a scale or marker), consumed while reading the weight it belongs to."""
    return key.endswith(SIDE_KEY_SUFFIXES) or key.rsplit(".", 1)[-1] in SIDE_KEYS


def pickle_refusal(path: Path) -> ModelSourceError:
    """The one message for every pickle: why not, and the one-liner to convert it oneself. The
    command writes a new file beside it, never over the pickle (a pickle named .safetensors) or a
    file already there. torch.load gets an open file: given a name ending in .safetensors, it reads
    it as safetensors and fails on a pickle."""
    out = path.with_suffix(".safetensors")
    if out == path or out.exists():
        out = path.with_name(f"{path.stem}.converted.safetensors")
    cmd = (f"python -c \"import torch, safetensors.torch as st; "
           f"sd = torch.load(open('{path}', 'rb'), weights_only=True, map_location='cpu'); "
           f"sd = sd.get('state_dict', sd); st.save_file({{k: v.contiguous() for k, v in "
           f"sd.items() if isinstance(v, torch.Tensor)}}, '{out}')\"")
    return ModelSourceError(
        f"{path} is a pickle file; imglora loads weights from .safetensors files only, because loading a "
        f"pickle can run any code it contains. Most models are published as .safetensors too: download "
        f"that file. If you trust this file's source, convert it once yourself:\n  {cmd}")


def check_file(path: PathLike) -> Path:
    """``path`` as a Path if it is a file that may be a safetensors file; refuses pickles by their
    extension or by their first bytes (a zip, as torch.save writes, or a raw pickle)."""
    path = Path(path).expanduser()
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise ModelSourceError(f"{path} {what}; give the path of a .safetensors weights file")
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise pickle_refusal(path)
    with open(path, "rb") as fh:
        head = fh.read(9)  # safetensors: 8-byte header length, then the JSON header's "{"
    if head[8:9] != b"{" and (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):
        raise pickle_refusal(path)  # torch.save's zip, or a bare pickle, whatever its extension
    return path


@contextmanager
def open_file(path: PathLike) -> Iterator[Reader]:
    """A Reader over ``path``; the header is parsed here, tensors are read (memory-mapped) on demand."""
    from safetensors import safe_open

    path = check_file(path)
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # SafetensorError, or OSError/ValueError for odd files
        size = path.stat().st_size
        raise ModelSourceError(
            f"{path} is not a readable safetensors file ({exc}; {size:,} bytes). A file that stops short, "
            "as after an interrupted download, reads like this: download it again, or check that it is "
            "the weights file and not a web page or a pickle.") from None
    with handle as fh:
        yield Reader(fh, path)


class Reader:
    """An open safetensors file: keys and shapes from the header, tensors in the dtype asked for."""

    def __init__(self, handle: Any, path: Path):
        self.handle, self.path = handle, path
        self.keys: list[str] = list(handle.keys())
        self.key_set = frozenset(self.keys)

    def metadata(self) -> dict[str, str]:
        return self.handle.metadata() or {}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.handle.get_slice(key).get_shape())

    def dtype_name(self, key: str) -> str:
        """The header's dtype string, e.g. ``"BF16"`` or ``"F8_E4M3"``."""
        return str(self.handle.get_slice(key).get_dtype())

    def with_prefix(self, prefix: str) -> list[str]:
        return [k for k in self.keys if k.startswith(prefix) and not is_side_key(k)]

    def scale(self, key: str) -> torch.Tensor | None:
        """The scalar that multiplies the stored fp8 ``key``, if the file has one."""
        if not key.endswith(".weight"):
            return None
        stem = key[: -len("weight")]
        for suffix in SCALE_SUFFIXES:
            if stem + suffix in self.key_set:
                scale = self.handle.get_tensor(stem + suffix).float()
                if scale.numel() != 1:
                    raise ModelSourceError(
                        f"{self.path}: {stem + suffix} holds {scale.numel()} scales (a block-quantized format "
                        "such as nvfp4); imglora reads fp8 with one scale per tensor only. Use the bf16 or "
                        "fp8 release of this model.")
                return scale.reshape(())
        return None

    def get(self, key: str, dtype: torch.dtype, *, device: torch.device | str = "cpu",
            rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``key`` (rows ``rows[0]:rows[1]`` only, if given) as a new ``dtype`` tensor on
        ``device`` that owns its memory.

        fp8 is upcast, and multiplied by its scale if the file has one, tensor by tensor, so the
        file is never held dequantized as a whole. The result never aliases the memory-mapped file:
        a model must not change if the file is rewritten while it is in use; and it is aligned
        (``imglora.util.owned``; under its test switch, deliberately not).
        """
        out = self._get(key, dtype, device, rows)
        return copy(out) if unaligned_reads() else out

    def _get(self, key: str, dtype: torch.dtype, device: torch.device | str,
             rows: tuple[int, int] | None) -> torch.Tensor:
        t = self.handle.get_tensor(key)
        if not t.is_floating_point():
            raise ModelSourceError(f"{self.path}: {key} is stored as {t.dtype}, a packed quantized format "
                                   "imglora cannot read; use the bf16 or fp8 release of this model")
        if rows is not None:
            t = t[rows[0]:rows[1]]
        scale = self.scale(key)
        if t.dtype in FP8_DTYPES or scale is not None:
            t = t.to(device=device).to(torch.float32)  # upcast where the result lives (less host memory)
            if scale is not None:
                t = t * scale.to(t.device)
            return t.to(dtype)
        return t.to(device=device, dtype=dtype, copy=True)

    def state(self, keys: Iterable[str], dtype: torch.dtype, *, strip: str = "",
              keep_fp32: Sequence[str] = ()) -> dict[str, torch.Tensor]:
        """``{key without strip: tensor}`` for ``keys``; modules named in keep_fp32 stay float32 when
        dtype is float16 (transformers' and diffusers' _keep_in_fp32_modules rule)."""
        out = {}
        for key in keys:
            name = key[len(strip):] if strip and key.startswith(strip) else key
            fp32 = dtype == torch.float16 and any(f".{m}." in f".{name}" for m in keep_fp32)
            out[name] = self.get(key, torch.float32 if fp32 else dtype)
        return out


def check_shapes(path: Path, what: str, got: Mapping[str, Sequence[int]], want: Mapping[str, Sequence[int]],
                 hint: str) -> None:
    """Raise, naming the keys, unless ``got`` has exactly the keys and shapes of ``want``.

    diffusers' single-file loading does not check this: a weight missing from the converted dict
    stays on the meta device and fails much later ("Cannot copy out of meta tensor")."""
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    shapes = [f"{k} (file {list(got[k])}, model {list(want[k])})"
              for k in sorted(set(got) & set(want)) if tuple(got[k]) != tuple(want[k])]
    problems = [f"{len(v)} {label}: {', '.join(v[:8])}{', ...' if len(v) > 8 else ''}"
                for label, v in (("missing", missing), ("unexpected", unexpected), ("with another shape", shapes))
                if v]
    if problems:
        raise ModelSourceError(f"{path}: the {what} does not fit {hint}: " + "; ".join(problems))


def note_ignored(path: Path, keys: Sequence[str]) -> None:
    """Tensors of the file the model has no place for (logit_scale, position_ids, ...): said, not
    fatal, as diffusers and ComfyUI also skip them. Missing ones are what check_shapes refuses."""
    if keys:
        log.info("%s: %d tensors not used by the model: %s%s", path, len(keys), ", ".join(keys[:6]),
                 ", ..." if len(keys) > 6 else "")


def empty_model(factory: Any) -> Any:
    """``factory()`` with its parameters on the meta device (no memory); buffers such as CLIP's
    position_ids stay real, as they are not in the files."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        return factory()


def fill(model: Any, state: dict[str, torch.Tensor], *, path: Path, what: str, hint: str) -> Any:
    """Check ``state`` against ``model``'s keys and shapes, then make its tensors the parameters
    (``assign``: the tensors read are the model, no second copy is made)."""
    check_shapes(path, what, {k: v.shape for k, v in state.items()},
                 {k: v.shape for k, v in model.state_dict().items()}, hint)
    model.load_state_dict(state, strict=True, assign=True)
    return own_module(model).eval()  # (a no-op unless the test switch put the tensors read at odd addresses)


def diffusers_config(cls: Any, config: PathLike | Mapping[str, Any], subfolder: str) -> dict[str, Any]:
    """A diffusers config dict from a dict, a component folder, a model folder (+ ``subfolder``)
    or a config.json file, never from the network."""
    if isinstance(config, Mapping):
        return dict(config)
    p = Path(config).expanduser()
    for candidate in (p, p / "config.json", p / subfolder / "config.json"):
        if candidate.is_file():
            return dict(cls.load_config(str(candidate)))
    raise ModelSourceError(f"no {cls.__name__} config at {p}: expected {p / 'config.json'} or "
                           f"{p / subfolder / 'config.json'} (a diffusers model folder of the same model)")


def hf_config(cls: Any, config: Any, subfolder: str) -> Any:
    """A transformers config from a config object, a dict, a folder (+ ``subfolder``) or a file."""
    if isinstance(config, cls):
        return config
    if isinstance(config, Mapping):
        return cls.from_dict(dict(config))
    p = Path(config).expanduser()
    for candidate in (p, p / "config.json", p / subfolder / "config.json"):
        if candidate.is_file():  # from_pretrained also unpacks a full CLIPConfig's text_config
            return cls.from_pretrained(str(candidate), local_files_only=True)
    raise ModelSourceError(f"no {cls.__name__} at {p}: expected {p / 'config.json'} or "
                           f"{p / subfolder / 'config.json'} (the text encoder's config.json)")

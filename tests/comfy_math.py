"""ComfyUI's LoRA/LoHa/LoKr/DoRA loading and patch math, reimplemented for the tests (fp32).

Read from Comfy-Org/ComfyUI (commit a125cd84, 2025-10-12); the structure follows it so each
piece can be compared line by line:

- ``load_lora``: ``comfy/lora.py::load_lora`` — per key prefix ``x`` of the key map, read
  ``{x}.alpha`` (``.item()``) and ``{x}.dora_scale``, then ask every adapter class in
  ``comfy/weight_adapter/__init__.py::adapters`` to load (the loop ``continue``s, so all are
  asked and the last match wins), then the ``diff``-family keys; every file key nobody consumed
  is logged as "lora key not loaded". GLoRA and BOFT are not reimplemented: their keys
  count as not loaded here, which can only over-report.
- ``LoRAAdapter``, ``LoHaAdapter``, ``LoKrAdapter``, ``OFTAdapter``: ``comfy/weight_adapter/{lora,loha,lokr,oft}.py``,
  ``load`` and ``calculate_weight``.
- ``weight_decompose``: ``comfy/weight_adapter/base.py::weight_decompose`` (DoRA), including its
  output-axis normalisation by the ORIGINAL weight's row norm.
- Errors: every ``calculate_weight`` wraps the diff and the update in ``try``/``except Exception``,
  logs ``ERROR <adapter> <key> <exception>`` and returns the weight unpatched; reproduced, with the
  message kept in ``Adapter.error`` (``patched_weight`` raises ComfyError on it by default).
- ``calculate_weight``: ``comfy/lora.py::calculate_weight`` for one patch, as
  ``comfy/model_patcher.py::ModelPatcher.patch_weight_to_device`` runs it: on an fp32 copy of the
  weight, intermediate dtype fp32. ``strength`` is the LoraLoader strength (``add_patches``'
  ``strength_patch``); ``strength_model`` stays 1 as ``comfy/sd.py::load_lora_for_models`` leaves it.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch
from torch import Tensor

Function = Callable[[Tensor], Tensor]


def _identity(a: Tensor) -> Tensor:
    return a


def weight_decompose(dora_scale: Tensor, weight: Tensor, lora_diff: Tensor, alpha: float, strength: float,
                     intermediate_dtype: torch.dtype, function: Function) -> Tensor:
    """``comfy/weight_adapter/base.py::weight_decompose``, line for line."""
    dora_scale = dora_scale.to(weight.device, intermediate_dtype)
    lora_diff *= alpha
    weight_calc = weight + function(lora_diff).type(weight.dtype)

    wd_on_output_axis = dora_scale.shape[0] == weight_calc.shape[0]
    if wd_on_output_axis:  # NB: the ORIGINAL weight's norm, not weight_calc's
        weight_norm = (weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True)
                       .reshape(weight.shape[0], *[1] * (weight.dim() - 1)))
    else:
        weight_norm = (weight_calc.transpose(0, 1).reshape(weight_calc.shape[1], -1).norm(dim=1, keepdim=True)
                       .reshape(weight_calc.shape[1], *[1] * (weight_calc.dim() - 1)).transpose(0, 1))
    weight_norm = weight_norm + torch.finfo(weight.dtype).eps

    weight_calc *= (dora_scale / weight_norm).type(weight.dtype)
    if strength != 1.0:
        weight_calc -= weight
        weight += strength * weight_calc
    else:
        weight[:] = weight_calc
    return weight


def _dev(t: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
    # comfy.model_management.cast_to_device(t, weight.device, intermediate_dtype)
    return t.to(weight.device, dtype)


class ComfyError(RuntimeError):
    """ComfyUI would log ``ERROR <adapter> <key> <exception>`` and leave the weight unpatched."""


class Adapter:
    name = ""

    def __init__(self, loaded_keys: set[str], weights: tuple):
        self.loaded_keys = loaded_keys
        self.weights = weights
        self.error: str | None = None  # what ComfyUI would have logged for the last calculate_weight

    def _apply(self, weight: Tensor, key: str, make_diff: Callable[[], Tensor], alpha: float, strength: float,
               dora_scale: Tensor | None, intermediate_dtype: torch.dtype, function: Function) -> Tensor:
        """The ``try:`` block every calculate_weight ends with: build ``lora_diff`` (reshape/kron),
        then DoRA or the plain update. ComfyUI catches any exception, logs it and returns the weight
        as it is (unpatched, or partly patched); so does this, recording the message in ``error``."""
        self.error = None
        try:
            lora_diff = make_diff()
            if dora_scale is not None:
                return weight_decompose(dora_scale, weight, lora_diff, alpha, strength, intermediate_dtype, function)
            weight += function(((strength * alpha) * lora_diff).type(weight.dtype))
        except Exception as e:  # noqa: BLE001 -- as ComfyUI
            self.error = f"ERROR {self.name} {key} {e}"
            logging.error(self.error)
        return weight


class LoRAAdapter(Adapter):
    """``comfy/weight_adapter/lora.py::LoRAAdapter`` (``load``, ``calculate_weight``)."""

    name = "lora"
    # (up, down, mid) in the order load() tries them; the first present "up" wins.
    FORMS = (("{}.lora_up.weight", "{}.lora_down.weight", "{}.lora_mid.weight"),  # kohya / LyCORIS
             ("{}_lora.up.weight", "{}_lora.down.weight", None),                   # old diffusers
             ("{}.lora_B.weight", "{}.lora_A.weight", None),                       # peft / diffusers
             ("{}.lora.up.weight", "{}.lora.down.weight", None),                   # diffusers 3
             ("{}.lora_B", "{}.lora_A", None),                                     # mochi
             ("{}.lora_linear_layer.up.weight", "{}.lora_linear_layer.down.weight", None),  # transformers
             ("{}.lora_B.default.weight", "{}.lora_A.default.weight", None))       # qwen default

    @classmethod
    def load(cls, x: str, lora: dict[str, Tensor], alpha: float | None, dora_scale: Tensor | None,
             loaded_keys: set[str]) -> "LoRAAdapter | None":
        for up_f, down_f, mid_f in cls.FORMS:
            up_name = up_f.format(x)
            if up_name not in lora:
                continue
            down_name = down_f.format(x)
            mid = None
            if mid_f is not None and mid_f.format(x) in lora:
                mid = lora[mid_f.format(x)]
                loaded_keys.add(mid_f.format(x))
            reshape = None
            if f"{x}.reshape_weight" in lora:
                reshape = lora[f"{x}.reshape_weight"].tolist()
                loaded_keys.add(f"{x}.reshape_weight")
            weights = (lora[up_name], lora[down_name], alpha, mid, dora_scale, reshape)
            loaded_keys.add(up_name)
            loaded_keys.add(down_name)
            return cls(loaded_keys, weights)
        return None

    def calculate_weight(self, weight: Tensor, key: str, strength: float, strength_model: float, offset,
                         function: Function, intermediate_dtype: torch.dtype = torch.float32) -> Tensor:
        v = self.weights
        mat1 = _dev(v[0], weight, intermediate_dtype)  # up
        mat2 = _dev(v[1], weight, intermediate_dtype)  # down
        dora_scale = v[4]
        if v[5] is not None:
            raise NotImplementedError("reshape_weight (pad_tensor_to_shape) is not reimplemented")
        alpha = v[2] / mat2.shape[0] if v[2] is not None else 1.0
        if v[3] is not None:  # LoCon mid (tucker)
            mat3 = _dev(v[3], weight, intermediate_dtype)
            final_shape = [mat2.shape[1], mat2.shape[0], mat3.shape[2], mat3.shape[3]]
            mat2 = torch.mm(mat2.transpose(0, 1).flatten(start_dim=1),
                            mat3.transpose(0, 1).flatten(start_dim=1)).reshape(final_shape).transpose(0, 1)
        return self._apply(weight, key, lambda: torch.mm(mat1.flatten(start_dim=1), mat2.flatten(start_dim=1))
                           .reshape(weight.shape), alpha, strength, dora_scale, intermediate_dtype, function)


class LoHaAdapter(Adapter):
    """``comfy/weight_adapter/loha.py::LoHaAdapter`` (``load``, ``calculate_weight``)."""

    name = "loha"

    @classmethod
    def load(cls, x, lora, alpha, dora_scale, loaded_keys) -> "LoHaAdapter | None":
        n = {s: f"{x}.{s}" for s in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")}
        if n["hada_w1_a"] not in lora:
            return None
        t1 = t2 = None
        if n["hada_t1"] in lora:
            t1, t2 = lora[n["hada_t1"]], lora[n["hada_t2"]]
            loaded_keys.add(n["hada_t1"])
            loaded_keys.add(n["hada_t2"])
        weights = (lora[n["hada_w1_a"]], lora[n["hada_w1_b"]], alpha, lora[n["hada_w2_a"]], lora[n["hada_w2_b"]],
                   t1, t2, dora_scale)
        loaded_keys.update({n["hada_w1_a"], n["hada_w1_b"], n["hada_w2_a"], n["hada_w2_b"]})
        return cls(loaded_keys, weights)

    def calculate_weight(self, weight, key, strength, strength_model, offset, function,
                         intermediate_dtype=torch.float32) -> Tensor:
        v = self.weights
        w1a, w1b = v[0], v[1]
        alpha = v[2] / w1b.shape[0] if v[2] is not None else 1.0
        w2a, w2b = v[3], v[4]
        dora_scale = v[7]
        c = lambda t: _dev(t, weight, intermediate_dtype)  # noqa: E731
        if v[5] is not None:  # CP decomposition
            m1 = torch.einsum("i j k l, j r, i p -> p r k l", c(v[5]), c(w1b), c(w1a))
            m2 = torch.einsum("i j k l, j r, i p -> p r k l", c(v[6]), c(w2b), c(w2a))
        else:
            m1 = torch.mm(c(w1a), c(w1b))
            m2 = torch.mm(c(w2a), c(w2b))
        return self._apply(weight, key, lambda: (m1 * m2).reshape(weight.shape), alpha, strength, dora_scale,
                           intermediate_dtype, function)


class LoKrAdapter(Adapter):
    """``comfy/weight_adapter/lokr.py::LoKrAdapter`` (``load``, ``calculate_weight``).

    Scale: ``alpha / dim`` with dim = ``lokr_w2_b.shape[0]`` if w2 is low-rank, else
    ``lokr_w1_b.shape[0]`` if w1 is; with both factors full, 1.0 whatever ``.alpha`` says.
    """

    name = "lokr"
    SUFFIXES = ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_t2")

    @classmethod
    def load(cls, x, lora, alpha, dora_scale, loaded_keys) -> "LoKrAdapter | None":
        got = {}
        for s in cls.SUFFIXES:
            name = f"{x}.{s}"
            got[s] = lora.get(name)
            if got[s] is not None:
                loaded_keys.add(name)
        if any(got[s] is not None for s in ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w2_a")):
            weights = (got["lokr_w1"], got["lokr_w2"], alpha, got["lokr_w1_a"], got["lokr_w1_b"],
                       got["lokr_w2_a"], got["lokr_w2_b"], got["lokr_t2"], dora_scale)
            return cls(loaded_keys, weights)
        return None

    def calculate_weight(self, weight, key, strength, strength_model, offset, function,
                         intermediate_dtype=torch.float32) -> Tensor:
        v = self.weights
        w1, w2, w1_a, w1_b, w2_a, w2_b, t2, dora_scale = v[0], v[1], v[3], v[4], v[5], v[6], v[7], v[8]
        c = lambda t: _dev(t, weight, intermediate_dtype)  # noqa: E731
        dim = None
        if w1 is None:
            dim = w1_b.shape[0]
            w1 = torch.mm(c(w1_a), c(w1_b))
        else:
            w1 = c(w1)
        if w2 is None:
            dim = w2_b.shape[0]
            if t2 is None:
                w2 = torch.mm(c(w2_a), c(w2_b))
            else:
                w2 = torch.einsum("i j k l, j r, i p -> p r k l", c(t2), c(w2_b), c(w2_a))
        else:
            w2 = c(w2)
        if len(w2.shape) == 4:
            w1 = w1.unsqueeze(2).unsqueeze(2)
        alpha = v[2] / dim if (v[2] is not None and dim is not None) else 1.0
        return self._apply(weight, key, lambda: torch.kron(w1, w2).reshape(weight.shape), alpha, strength,
                           dora_scale, intermediate_dtype, function)


class OFTAdapter(Adapter):
    """``comfy/weight_adapter/oft.py::OFTAdapter`` (``load``, ``calculate_weight``): per block of the
    weight's rows, ``R = (I + Q)(I − Q)⁻¹`` with ``Q = B − Bᵀ`` of ``oft_blocks`` B (norm-constrained to
    alpha when alpha > 0), and ``W += s · (s·R − s·I)ᵀ-einsum W`` (strength applied twice)."""

    name = "oft"

    @classmethod
    def load(cls, x, lora, alpha, dora_scale, loaded_keys) -> "OFTAdapter | None":
        blocks = lora.get(f"{x}.oft_blocks")
        if blocks is None or blocks.ndim != 3:
            return None
        loaded_keys.add(f"{x}.oft_blocks")
        rescale = lora.get(f"{x}.rescale")
        if rescale is not None:
            loaded_keys.add(f"{x}.rescale")
        return cls(loaded_keys, (blocks, rescale, alpha, dora_scale))

    def calculate_weight(self, weight, key, strength, strength_model, offset, function,
                         intermediate_dtype=torch.float32) -> Tensor:
        blocks, rescale, alpha, dora_scale = self.weights
        alpha = 0 if alpha is None else alpha
        blocks = _dev(blocks, weight, intermediate_dtype)
        block_num, block_size, *_ = blocks.shape
        self.error = None
        try:
            eye = torch.eye(block_size, device=blocks.device, dtype=blocks.dtype)
            q = blocks - blocks.transpose(1, 2)
            normed_q = q
            if alpha > 0:  # alpha in oft/boft is for constraint
                q_norm = torch.norm(q) + 1e-8
                if q_norm > alpha:
                    normed_q = q * alpha / q_norm
            r = (eye + normed_q) @ (eye - normed_q).float().inverse()
            r = r.to(weight)
            _, *shape = weight.shape
            lora_diff = torch.einsum("k n m, k n ... -> k m ...", (r * strength) - strength * eye,
                                     weight.view(block_num, block_size, *shape)).view(-1, *shape)
            if dora_scale is not None:
                return weight_decompose(dora_scale, weight, lora_diff, alpha, strength, intermediate_dtype, function)
            weight += function((strength * lora_diff).type(weight.dtype))
        except Exception as e:  # noqa: BLE001 -- as ComfyUI
            self.error = f"ERROR {self.name} {key} {e}"
            logging.error(self.error)
        return weight


ADAPTERS = (LoRAAdapter, LoHaAdapter, LoKrAdapter, OFTAdapter)  # GLoRA, BOFT: not reimplemented
DIFF_SUFFIXES = ("w_norm", "b_norm", "diff", "diff_b", "set_weight")  # consumed by load_lora itself


def load_lora(lora: dict[str, Tensor], to_load: Iterable[str]) -> tuple[dict[str, Adapter], set[str]]:
    """``comfy/lora.py::load_lora``: ({prefix: adapter}, keys ComfyUI logs as "lora key not loaded").

    ``to_load``: the key prefixes ComfyUI's key map holds (the targets do not matter here).
    ``diff``-family patches are consumed but not returned.
    """
    patches: dict[str, Adapter] = {}
    loaded_keys: set[str] = set()
    for x in to_load:
        alpha = None
        if f"{x}.alpha" in lora:
            alpha = lora[f"{x}.alpha"].item()
            loaded_keys.add(f"{x}.alpha")
        dora_scale = None
        if f"{x}.dora_scale" in lora:
            dora_scale = lora[f"{x}.dora_scale"]
            loaded_keys.add(f"{x}.dora_scale")
        for adapter_cls in ADAPTERS:
            adapter = adapter_cls.load(x, lora, alpha, dora_scale, loaded_keys)
            if adapter is not None:
                patches[x] = adapter
                loaded_keys.update(adapter.loaded_keys)
                continue  # as ComfyUI: not break, a later class may replace it
        for s in DIFF_SUFFIXES:
            if f"{x}.{s}" in lora:
                loaded_keys.add(f"{x}.{s}")
    return patches, set(lora) - loaded_keys


def keys_not_loaded(lora: dict[str, Tensor], prefixes: str | Iterable[str]) -> set[str]:
    """The file keys ComfyUI would report as "lora key not loaded" when its key map holds ``prefixes``."""
    if isinstance(prefixes, str):
        prefixes = [prefixes]
    return load_lora(lora, prefixes)[1]


def calculate_weight(adapter: Adapter, weight: Tensor, key: str = "", strength: float = 1.0,
                     strength_model: float = 1.0, function: Function | None = None) -> Tensor:
    """``comfy/lora.py::calculate_weight`` for one adapter patch without offset, on an fp32 copy
    (``ModelPatcher.patch_weight_to_device``); returns the patched fp32 weight."""
    weight = weight.detach().to(torch.float32, copy=True)
    if strength_model != 1.0:
        weight *= strength_model
    return adapter.calculate_weight(weight, key, strength, strength_model, None, function or _identity,
                                    torch.float32)


def patched_weight(lora: dict[str, Tensor], prefix: str, weight: Tensor, strength: float = 1.0, *,
                   strict: bool = True) -> Tensor:
    """The weight ComfyUI's LoraLoader at ``strength`` leaves for the module keyed ``prefix``.

    ``strict``: raise ComfyError where ComfyUI would log an ERROR and keep the weight unpatched."""
    patches, _ = load_lora(lora, [prefix])
    if prefix not in patches:
        raise KeyError(f"ComfyUI loads no adapter for {prefix!r}")
    out = calculate_weight(patches[prefix], weight, prefix, strength)
    if strict and patches[prefix].error:
        raise ComfyError(patches[prefix].error)
    return out

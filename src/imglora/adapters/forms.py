"""One adapted module in peft's form and in the form ComfyUI loads, for any adapter type: the
type-free entry points over ``imglora.adapters.KINDS`` (each type's math is in its own file).

- ``read_peft_module`` groups one module's tensors from a peft adapter state dict
  (``get_peft_model_state_dict`` after ``inject_adapter_in_model``: no prefix, adapter name removed)
  and checks them. peft keeps alpha out of the state dict, so alpha and rank are given (per module,
  after ``alpha_pattern``/``rank_pattern``).
- ``comfy_tensors`` gives the kohya/LyCORIS suffixes ComfyUI reads (``lora_up.weight``,
  ``lora_down.weight``, ``alpha``, ``dora_scale``; ``hada_*``; ``lokr_*``; ``oft_blocks``), chosen
  so that ComfyUI's patch math (``comfy/weight_adapter/*.py``) rebuilds peft's merged weight.
- ``delta`` is the merged weight minus the base weight, as peft computes it.

diffusers' ``load_lora_weights`` loads LoRA and DoRA (its ``lora_magnitude_vector``), neither LoHa
nor LoKr.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from . import KINDS as _KINDS
from .dora import dora_scale  # noqa: F401  (the entry point of DoRA's scale, kept here for callers)
from .kind import COMFY_EPS, Module  # noqa: F401
from .lokr import flat_w2 as lokr_flat_w2  # noqa: F401
from ..errors import ImgloraError

KINDS = tuple(_KINDS)
PEFT_SUFFIXES = {k.name: k.suffixes for k in _KINDS.values()}  # every suffix peft's state dict can hold per module
ADAPTER_PREFIXES = tuple(dict.fromkeys(k.prefix for k in _KINDS.values()))
_ALL_SUFFIXES = {s for k in _KINDS.values() for s in k.suffixes}


def _carries_name(suffix: str) -> bool:
    """``lora_A.default.weight``, ``hada_w1_a.default``: a suffix with peft's adapter name still in it."""
    parts = suffix.split(".")
    return suffix not in _ALL_SUFFIXES and len(parts) > 1 and (
        parts[0] in _ALL_SUFFIXES or f"{parts[0]}.{parts[-1]}" in _ALL_SUFFIXES)


# ---------------------------------------------------------------------------------------------
# Reading peft's state dict
# ---------------------------------------------------------------------------------------------


def read_peft_module(state: dict[str, Tensor], module: str, kind: str, alpha: float, rank: int, *,
                     use_rslora: bool = False, shape: Sequence[int] | None = None) -> Module:
    """Group ``module``'s tensors of a peft state dict (keys ``<module>.<suffix>``, no adapter name).

    ``kind``: "lora", "dora" (peft LoRA with ``use_dora=True``), "loha" or "lokr". ``alpha`` and
    ``rank``: the module's peft ``lora_alpha``/``alpha`` and ``r`` (after any alpha/rank pattern).
    ``use_rslora`` (LoRA/DoRA): peft scales by alpha / sqrt(r). ``shape``: the base weight's shape,
    needed only by ``delta`` without a base weight for flattened conv forms (LoHa/LoKr on Conv2d
    without ``use_effective_conv2d``). Raises ImgloraError for missing, partial or foreign tensors.
    """
    if kind not in KINDS:
        raise ImgloraError(f"{module}: adapter type {kind!r} is not one of {', '.join(KINDS)}")
    if not rank or rank <= 0:
        raise ImgloraError(f"{module}: rank must be a positive integer, got {rank!r}")
    if use_rslora and not _KINDS[kind].rslora:
        raise ImgloraError(f"{module}: rsLoRA scaling exists for LoRA/DoRA only, not {kind}")
    head = f"{module}."
    own = {k[len(head):]: v for k, v in state.items()
           if k.startswith(head) and k[len(head):].split(".", 1)[0].startswith(ADAPTER_PREFIXES)}
    if not own:
        raise ImgloraError(f"{module}: no adapter tensors in the state dict (keys {head}lora_A.weight, "
                           f"{head}hada_w1_a, {head}lokr_w1, ...)")
    named = [s for s in own if _carries_name(s)]
    if named:
        raise ImgloraError(f"{module}: {head}{named[0]} still carries an adapter name; read a state dict from "
                           "peft's get_peft_model_state_dict, which removes it")
    foreign = sorted(set(own) - set(PEFT_SUFFIXES[kind]))
    if foreign:
        hint = ""
        fits = [k.name for k in _KINDS.values() if set(own) <= set(k.suffixes)]
        if fits:
            hint = f" (its tensors are a {fits[0]} adapter's: use kind {fits[0]!r})"
        elif foreign[0].endswith(".bias"):
            hint = " (LoRA biases, peft lora_bias=True, have no ComfyUI LoRA form)"
        raise ImgloraError(f"{module}: {head}{foreign[0]} does not belong to a {kind} adapter{hint}")
    m = Module(module, kind, {k: own[k] for k in PEFT_SUFFIXES[kind] if k in own}, float(alpha), int(rank),
               bool(use_rslora), tuple(int(n) for n in shape) if shape is not None else None)
    _KINDS[kind].check(m)
    return m


def natural_shape(m: Module) -> tuple[int, ...]:
    """The shape of the adapter's weight before peft reshapes it to the base weight's shape.

    LoRA: (out, in[, kh, kw]). LoHa/LoKr on Conv2d without the CP (``use_effective_conv2d``) form
    are flat, (out, in·kh·kw), like a Linear; only the base weight tells them apart.
    """
    return _KINDS[m.kind].natural_shape(m)


def delta(m: Module, base_weight: Tensor | None = None) -> Tensor:
    """peft's merged weight minus the base weight, shaped like the base weight, in fp32 (fp64 in, fp64 out).

    LoRA/LoHa/LoKr: ``get_delta_weight`` (scaling included); ``base_weight`` only gives the shape
    (else ``m.shape``, else the adapter's own shape). DoRA and OFT depend on ``base_weight``.
    """
    return _KINDS[m.kind].delta(m, base_weight)


def comfy_tensors(m: Module, base_weight: Tensor | None = None) -> dict[str, Tensor]:
    """``{suffix: tensor}`` that ComfyUI turns into exactly peft's merged weight for this module.

    Suffixes: prefix each with the module's ComfyUI key and a dot. Tensors keep their dtype
    (``alpha`` is a 0-dim fp32; ``dora_scale`` fp32, fp64 for an fp64 base weight; keep it fp32 in the
    file: bf16 would round away what the compensation adds). DoRA needs ``base_weight`` (the weight
    ComfyUI patches); the other types use it, when given, only to check the shapes.
    """
    return _KINDS[m.kind].comfy_tensors(m, base_weight)

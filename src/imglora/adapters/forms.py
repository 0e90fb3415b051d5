"""One adapted module in peft's form and in the form ComfyUI loads: LoRA, DoRA, LoHa, LoKr, OFT
(``imglora.adapters.oft``: ``oft_R.weight`` -> ``oft_blocks``).

Family-unaware: this works on one module at a time; naming the module (``lora_unet_…``,
``transformer.…``) is the exporter's job. Three functions:

- ``read_peft_module`` groups one module's tensors from a peft adapter state dict
  (``get_peft_model_state_dict`` after ``inject_adapter_in_model``: no prefix, adapter name removed):
  LoRA ``lora_A.weight``/``lora_B.weight`` (+ ``lora_magnitude_vector`` for DoRA); LoHa
  ``hada_w1_a``, ``hada_w1_b``, ``hada_w2_a``, ``hada_w2_b`` (+ ``hada_t1``/``hada_t2``); LoKr
  ``lokr_w1`` or ``lokr_w1_a``/``lokr_w1_b``, ``lokr_w2`` or ``lokr_w2_a``/``lokr_w2_b`` (+ ``lokr_t2``).
  peft keeps alpha out of the state dict, so alpha and rank are given (per module, after
  ``alpha_pattern``/``rank_pattern``).
- ``comfy_tensors`` gives the kohya/LyCORIS suffixes ComfyUI reads (``lora_up.weight``,
  ``lora_down.weight``, ``alpha``, ``dora_scale``; ``hada_*``; ``lokr_*``), chosen so that ComfyUI's
  patch math (``comfy/weight_adapter/lora.py``, ``loha.py``, ``lokr.py`` ``calculate_weight`` and
  ``base.py::weight_decompose``) rebuilds peft's merged weight.
- ``delta`` is the merged weight minus the base weight, as peft computes it.

How each type maps (ComfyUI scales by ``alpha / rank``, rank = rows of ``lora_down``/``hada_w1_b``,
or of ``lokr_w2_b`` else ``lokr_w1_b``; peft scales by ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA):

- LoRA: ``lora_up = lora_B``, ``lora_down = lora_A``, ``alpha = scaling · r``.
- LoHa: the tensors as they are (same shapes, same CP einsum), ``alpha = alpha``.
- LoKr: the tensors as they are, ``alpha = alpha`` when at least one factor is low-rank. When both
  ``lokr_w1`` and ``lokr_w2`` are full matrices ComfyUI ignores ``.alpha`` (scale 1) while peft
  still scales by ``alpha / r``, so the scale is folded into ``lokr_w1`` and no ``.alpha`` is written.
  The CP form of Conv2d (``use_effective_conv2d``: ``lokr_t2`` with ``lokr_w2_a (r, out_k)``,
  ``lokr_w2_b (r, in_n)``) is rewritten as the equivalent flat pair ``lokr_w2_a (out_k, r)``,
  ``lokr_w2_b (r, in_n·kh·kw)`` of the same rank: ComfyUI's LoKrAdapter hands the CP einsum's
  non-contiguous result to ``torch.kron``, which raises (Comfy-Org/ComfyUI#11245) and leaves the
  layer unpatched. (LoHa's CP form has no such problem: it only reshapes.)
- DoRA (peft LoRA with ``use_dora=True``): peft's magnitude ``m`` (Linear ``(out,)``, Conv
  ``(1, out, 1, 1)``) gives ``W' = m / ‖W0 + sΔ‖_row · (W0 + sΔ)``, the norm per output row of the
  MERGED weight, no eps (``peft/tuners/lora/variants.py::DoraLinearVariant.merge_safe``).
  ComfyUI's ``weight_decompose`` takes a ``dora_scale`` whose first dimension equals the weight's as
  output-axis and computes ``W' = (W0 + sΔ) · dora_scale / (‖W0‖_row + eps)``: it divides by the
  norm of the ORIGINAL weight (eps = ``torch.finfo(float32).eps`` in its normal fp32 patching).
  So this module exports the compensated value

      dora_scale = m · (‖W0‖_row + eps) / ‖W0 + sΔ‖_row,   shaped (out, 1) / (out, 1, 1, 1)

  which needs the base weight (pass it as ComfyUI will hold it: the checkpoint's weight in fp32;
  for FLUX q/k/v the module's own weight, which is the row slice ComfyUI narrows to). Never 1-D:
  a ``(out,)`` scale broadcasts to ``(out, out)`` in ComfyUI (Comfy-Org/ComfyUI#12938), which is
  silently wrong for square weights and leaves other weights unpatched.
  Caveats: the open ComfyUI PR #15458 ("fix: normalize output-axis DoRA with adapted weights")
  would divide by ``‖W0 + sΔ‖`` instead; if it lands, these files scale each output row by
  ``(‖W0‖ + eps) / ‖W0 + sΔ‖`` too much, and the plain magnitude ``m`` becomes the exact value.
  ComfyUI's low-VRAM path (``model_patcher.LowVramPatch``) patches in the weight's own dtype, so
  its eps is that dtype's (bf16: 2**-7); the compensation assumes fp32 patching. The magnitude is
  per output row, so fusing q/k/v rows into one qkv weight would keep it exact, but a ``function``
  that permutes rows (FLUX ``norm_out``'s scale/shift swap) is applied to the delta and not to
  ``dora_scale``: the exporter has to permute ``dora_scale`` itself there.
  diffusers' ``load_lora_weights`` drops kohya ``dora_scale`` keys and reads only peft's
  ``lora_magnitude_vector``; it loads neither LoHa nor LoKr.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor

from . import oft
from ..errors import ImgloraError

KINDS = ("lora", "dora", "loha", "lokr", "oft")

# Every suffix peft's state dict can hold per module, by kind.
PEFT_SUFFIXES = {
    "lora": ("lora_A.weight", "lora_B.weight"),
    "dora": ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector"),
    "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"),
    "lokr": ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"),
    "oft": ("oft_R.weight",),  # imglora.adapters.oft: peft's rotation, applied to the layer's output
}
ADAPTER_PREFIXES = ("lora_", "hada_", "lokr_", "oft_")

# ComfyUI's weight_decompose adds the eps of the weight's dtype; its normal patching is in fp32.
COMFY_EPS = torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class Module:
    """One adapted module: its peft tensors (by peft suffix) and the scale peft applies."""

    name: str                        # module path as in the state dict, e.g. "down_blocks.0.resnets.0.conv1"
    kind: str                        # "lora", "dora", "loha" or "lokr"
    tensors: Mapping[str, Tensor]    # peft suffix -> tensor ("lora_A.weight", "hada_w1_a", "lokr_w1", ...)
    alpha: float
    rank: int
    use_rslora: bool = False
    shape: tuple[int, ...] | None = None  # the base weight's shape, when known

    @property
    def scaling(self) -> float:
        """peft's ``scaling``: alpha / r, or alpha / sqrt(r) with rsLoRA (LoRA and DoRA only)."""
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank

    def get(self, suffix: str) -> Tensor | None:
        return self.tensors.get(suffix)


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
    if use_rslora and kind not in ("lora", "dora"):
        raise ImgloraError(f"{module}: rsLoRA scaling exists for LoRA/DoRA only, not {kind}")
    head = f"{module}."
    own = {k[len(head):]: v for k, v in state.items()
           if k.startswith(head) and k[len(head):].split(".", 1)[0].startswith(ADAPTER_PREFIXES)}
    if not own:
        raise ImgloraError(f"{module}: no adapter tensors in the state dict (keys {head}lora_A.weight, "
                           f"{head}hada_w1_a, {head}lokr_w1, ...)")
    named = [s for s in own
             if s.count(".") > (1 if s.startswith(("lora_", "oft_")) and s != "lora_magnitude_vector" else 0)]
    if named:
        raise ImgloraError(f"{module}: {head}{named[0]} still carries an adapter name; read a state dict from "
                           "peft's get_peft_model_state_dict, which removes it")
    foreign = sorted(set(own) - set(PEFT_SUFFIXES[kind]))
    if foreign:
        hint = ""
        if kind == "lora" and "lora_magnitude_vector" in own:
            hint = " (a lora_magnitude_vector means DoRA: use kind 'dora')"
        elif foreign[0].endswith(".bias"):
            hint = " (LoRA biases, peft lora_bias=True, have no ComfyUI LoRA form)"
        raise ImgloraError(f"{module}: {head}{foreign[0]} does not belong to a {kind} adapter{hint}")
    m = Module(module, kind, {k: own[k] for k in PEFT_SUFFIXES[kind] if k in own}, float(alpha), int(rank),
               bool(use_rslora), tuple(int(n) for n in shape) if shape is not None else None)
    _check(m)
    return m


def _need(m: Module, *suffixes: str) -> None:
    missing = [s for s in suffixes if s not in m.tensors]
    if missing:
        raise ImgloraError(f"{m.name}: {m.kind} adapter without {m.name}.{missing[0]}")


def _fail(m: Module, what: str) -> None:
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in m.tensors.items())
    raise ImgloraError(f"{m.name}: {m.kind} tensors do not fit together ({what}): {shapes}")


def _check(m: Module) -> None:
    """Completeness and shape consistency, including the given rank against the tensors."""
    t = m.tensors
    if m.kind == "oft":
        _need(m, "oft_R.weight")
        vec = t["oft_R.weight"]
        try:
            b = oft.block_size(vec)
        except ValueError as exc:
            _fail(m, str(exc))
        if b != m.rank:
            _fail(m, f"block size {m.rank} given, the rotation's blocks are {b} wide")
        if m.shape is not None and vec.shape[0] * b != m.shape[0]:
            _fail(m, f"{vec.shape[0]} blocks of {b} rotate {vec.shape[0] * b} outputs, the base weight has {m.shape[0]}")
        return
    if m.kind in ("lora", "dora"):
        _need(m, "lora_A.weight", "lora_B.weight", *(["lora_magnitude_vector"] if m.kind == "dora" else []))
        a, b = t["lora_A.weight"], t["lora_B.weight"]
        if a.dim() not in (2, 4) or b.dim() != a.dim() or b.shape[1] != a.shape[0] or b.shape[2:] not in (
                torch.Size(), torch.Size([1, 1])):
            _fail(m, "lora_B must be (out, r[, 1, 1]) and lora_A (r, in[, kh, kw])")
        if a.shape[0] != m.rank:
            _fail(m, f"rank {m.rank} given, lora_A has {a.shape[0]} rows; pass the module's rank_pattern rank")
        if m.kind == "dora" and t["lora_magnitude_vector"].numel() != b.shape[0]:
            _fail(m, "the DoRA magnitude needs one value per output row")
    elif m.kind == "loha":
        _need(m, "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
        if ("hada_t1" in t) != ("hada_t2" in t):
            _fail(m, "hada_t1 and hada_t2 come together")
        for i in "12":
            wa, wb = t[f"hada_w{i}_a"], t[f"hada_w{i}_b"]
            if f"hada_t{i}" in t:
                tt = t[f"hada_t{i}"]
                ok = tt.dim() == 4 and wa.dim() == wb.dim() == 2 and tt.shape[0] == wa.shape[0] == m.rank \
                    and tt.shape[1] == wb.shape[0] == m.rank
            else:
                ok = wa.dim() == wb.dim() == 2 and wa.shape[1] == wb.shape[0] == m.rank
            if not ok:
                _fail(m, f"hada_w{i}_a/hada_w{i}_b (and hada_t{i}) must share rank {m.rank}")
        if _loha_factor_shape(m, "1") != _loha_factor_shape(m, "2"):
            _fail(m, "the two Hadamard factors must have the same shape")
    else:
        if "lokr_w1" in t and ("lokr_w1_a" in t or "lokr_w1_b" in t):
            _fail(m, "lokr_w1 is either full (lokr_w1) or low-rank (lokr_w1_a, lokr_w1_b)")
        if "lokr_w2" in t and ("lokr_w2_a" in t or "lokr_w2_b" in t or "lokr_t2" in t):
            _fail(m, "lokr_w2 is either full (lokr_w2) or low-rank (lokr_w2_a, lokr_w2_b[, lokr_t2])")
        if "lokr_w1" not in t:
            _need(m, "lokr_w1_a", "lokr_w1_b")
            a, b = t["lokr_w1_a"], t["lokr_w1_b"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or b.shape[0] != m.rank:
                _fail(m, f"lokr_w1_a (a, r) and lokr_w1_b (r, c) with r = {m.rank}")
        elif t["lokr_w1"].dim() != 2:
            _fail(m, "lokr_w1 must be 2-D")
        if "lokr_w2" not in t:
            _need(m, "lokr_w2_a", "lokr_w2_b")
            a, b = t["lokr_w2_a"], t["lokr_w2_b"]
            if "lokr_t2" in t:
                t2 = t["lokr_t2"]
                ok = t2.dim() == 4 and a.dim() == b.dim() == 2 and t2.shape[0] == a.shape[0] == m.rank \
                    and t2.shape[1] == b.shape[0] == m.rank
            else:
                ok = a.dim() == b.dim() == 2 and a.shape[1] == b.shape[0] == m.rank
            if not ok:
                _fail(m, f"lokr_w2_a/lokr_w2_b (and lokr_t2) must share rank {m.rank}")
        elif t["lokr_w2"].dim() not in (2, 4):
            _fail(m, "lokr_w2 must be 2-D or 4-D")
    if m.shape is not None:
        natural = natural_shape(m)
        if math.prod(natural) != math.prod(m.shape) or natural[0] != m.shape[0]:
            _fail(m, f"the adapter's weight {tuple(natural)} does not fit the base weight {m.shape}")


def _loha_factor_shape(m: Module, i: str) -> tuple[int, ...]:
    t = m.tensors
    if f"hada_t{i}" in t:
        tt = t[f"hada_t{i}"]
        return (t[f"hada_w{i}_a"].shape[1], t[f"hada_w{i}_b"].shape[1], *tt.shape[2:])
    return (t[f"hada_w{i}_a"].shape[0], t[f"hada_w{i}_b"].shape[1])


def natural_shape(m: Module) -> tuple[int, ...]:
    """The shape of the adapter's weight before peft reshapes it to the base weight's shape.

    LoRA: (out, in[, kh, kw]). LoHa/LoKr on Conv2d without the CP (``use_effective_conv2d``) form
    are flat, (out, in·kh·kw), like a Linear; only the base weight tells them apart.
    """
    t = m.tensors
    if m.kind in ("lora", "dora"):
        a, b = t["lora_A.weight"], t["lora_B.weight"]
        return (b.shape[0], *a.shape[1:])
    if m.kind == "loha":
        return _loha_factor_shape(m, "1")
    w1 = t["lokr_w1"].shape if "lokr_w1" in t else (t["lokr_w1_a"].shape[0], t["lokr_w1_b"].shape[1])
    if "lokr_w2" in t:
        w2 = tuple(t["lokr_w2"].shape)
    elif "lokr_t2" in t:
        w2 = (t["lokr_w2_a"].shape[1], t["lokr_w2_b"].shape[1], *t["lokr_t2"].shape[2:])
    else:
        w2 = (t["lokr_w2_a"].shape[0], t["lokr_w2_b"].shape[1])
    return (w1[0] * w2[0], w1[1] * w2[1], *w2[2:])


# ---------------------------------------------------------------------------------------------
# peft's math
# ---------------------------------------------------------------------------------------------


def _f(t: Tensor) -> Tensor:
    """At least fp32 (the math of half-precision adapters is done in fp32)."""
    return t.detach() if t.dtype == torch.float64 else t.detach().float()


def _target_shape(m: Module, base_weight: Tensor | None) -> tuple[int, ...]:
    if base_weight is not None:
        natural = natural_shape(m)
        if math.prod(natural) != base_weight.numel() or natural[0] != base_weight.shape[0]:
            _fail(m, f"the adapter's weight {tuple(natural)} does not fit the base weight "
                     f"{tuple(base_weight.shape)}")
        return tuple(base_weight.shape)
    return m.shape if m.shape is not None else natural_shape(m)


def _cp(t: Tensor, wa: Tensor, wb: Tensor) -> Tensor:
    # peft's make_weight_cp (loha: "i j k l, j r, i p -> p r k l" with (t, wb, wa); lokr: "i j k l, i p, j r")
    return torch.einsum("i j k l, i p, j r -> p r k l", _f(t), _f(wa), _f(wb))


def _unscaled(m: Module) -> Tensor:
    """The adapter's weight before peft's ``scaling`` and before reshaping (peft's get_delta_weight)."""
    t = m.tensors
    if m.kind in ("lora", "dora"):
        a, b = _f(t["lora_A.weight"]), _f(t["lora_B.weight"])
        return (b.flatten(1) @ a.flatten(1)).reshape(b.shape[0], *a.shape[1:])
    if m.kind == "loha":
        if "hada_t1" in t:
            return _cp(t["hada_t1"], t["hada_w1_a"], t["hada_w1_b"]) * _cp(t["hada_t2"], t["hada_w2_a"], t["hada_w2_b"])
        return (_f(t["hada_w1_a"]) @ _f(t["hada_w1_b"])) * (_f(t["hada_w2_a"]) @ _f(t["hada_w2_b"]))
    w1 = _f(t["lokr_w1"]) if "lokr_w1" in t else _f(t["lokr_w1_a"]) @ _f(t["lokr_w1_b"])
    if "lokr_w2" in t:
        w2 = _f(t["lokr_w2"])
    elif "lokr_t2" in t:
        w2 = _cp(t["lokr_t2"], t["lokr_w2_a"], t["lokr_w2_b"])
    else:
        w2 = _f(t["lokr_w2_a"]) @ _f(t["lokr_w2_b"])
    if w2.dim() == 4:
        w1 = w1[:, :, None, None]
    return torch.kron(w1, w2.contiguous())  # as peft's make_kron: kron needs a contiguous CP factor


def _row_norm(w: Tensor) -> Tensor:
    """Norm per output row, shaped (out, 1[, 1, 1]) (peft DoRA's get_weight_norm, ComfyUI's output axis)."""
    return w.reshape(w.shape[0], -1).norm(dim=1).reshape(w.shape[0], *[1] * (w.dim() - 1))


def _magnitude(m: Module, like: Tensor) -> Tensor:
    return _f(m.tensors["lora_magnitude_vector"]).reshape(like.shape[0], *[1] * (like.dim() - 1))


def delta(m: Module, base_weight: Tensor | None = None) -> Tensor:
    """peft's merged weight minus the base weight, shaped like the base weight, in fp32 (fp64 in, fp64 out).

    LoRA/LoHa/LoKr: ``get_delta_weight`` (scaling included); ``base_weight`` only gives the shape
    (else ``m.shape``, else the adapter's own shape). DoRA: ``m / ‖W0 + sΔ‖_row · (W0 + sΔ) − W0``,
    as peft's ``merge``; needs ``base_weight``.
    """
    if m.kind == "oft":  # a rotation of the weight's rows: it depends on the weight
        if base_weight is None:
            raise ImgloraError(f"{m.name}: an OFT delta depends on the base weight; pass base_weight")
        return oft.delta(m.tensors["oft_R.weight"], base_weight)
    shape = _target_shape(m, base_weight)
    d = (_unscaled(m) * m.scaling).reshape(shape)
    if m.kind != "dora":
        return d
    if base_weight is None:
        raise ImgloraError(f"{m.name}: a DoRA delta depends on the base weight; pass base_weight")
    w0 = _f(base_weight).to(d.dtype)
    merged = w0 + d
    return _magnitude(m, merged) / _row_norm(merged) * merged - w0


# ---------------------------------------------------------------------------------------------
# ComfyUI's form
# ---------------------------------------------------------------------------------------------


def _alpha(value: float) -> Tensor:
    # A 0-dim float32, as kohya and LyCORIS write it; ComfyUI reads it with .item().
    return torch.tensor(float(value), dtype=torch.float32)


def _copy(t: Tensor) -> Tensor:
    return t.detach().clone().contiguous()  # never share storage with the model (safetensors refuses shared tensors)


def comfy_tensors(m: Module, base_weight: Tensor | None = None) -> dict[str, Tensor]:
    """``{suffix: tensor}`` that ComfyUI turns into exactly peft's merged weight for this module.

    Suffixes (prefix each with the module's ComfyUI key and a dot): LoRA ``lora_up.weight``,
    ``lora_down.weight``, ``alpha`` (+ ``dora_scale`` for DoRA); LoHa ``hada_w1_a``, ``hada_w1_b``,
    ``hada_w2_a``, ``hada_w2_b`` (+ ``hada_t1``, ``hada_t2``), ``alpha``; LoKr the ``lokr_*``
    tensors present (``lokr_t2`` folded into a flat ``lokr_w2_a``/``lokr_w2_b``), plus ``alpha``
    unless both Kronecker factors are full (then the scale is in ``lokr_w1``). Tensors keep their
    dtype (``alpha`` is a 0-dim fp32; ``dora_scale`` fp32, fp64 for an fp64 base weight; keep it
    fp32 in the file: bf16 would round away what the compensation adds). DoRA needs ``base_weight`` (the weight ComfyUI patches, see the module docstring); the
    other types use it, when given, only to check the shapes.
    """
    t = m.tensors
    if m.kind == "oft":  # ComfyUI's OFTAdapter: oft_blocks, no alpha (it would be a norm constraint)
        if base_weight is not None and t["oft_R.weight"].shape[0] * m.rank != base_weight.shape[0]:
            _fail(m, f"the rotation's blocks do not cover the base weight's {base_weight.shape[0]} outputs")
        return {"oft_blocks": oft.comfy_blocks(t["oft_R.weight"])}
    if base_weight is not None:
        _target_shape(m, base_weight)
    if m.kind in ("lora", "dora"):
        # ComfyUI: alpha / lora_down.shape[0] == alpha / r; peft: scaling (alpha / r, or alpha / sqrt(r)).
        out = {"lora_up.weight": _copy(t["lora_B.weight"]), "lora_down.weight": _copy(t["lora_A.weight"]),
               "alpha": _alpha(m.alpha if not m.use_rslora else m.scaling * m.rank)}
        if m.kind == "dora":
            out["dora_scale"] = dora_scale(m, base_weight)
        return out
    if m.kind == "loha":
        # ComfyUI: alpha / hada_w1_b.shape[0]; hada_w1_b has r rows in the plain and in the CP layout.
        return {**{k: _copy(v) for k, v in t.items()}, "alpha": _alpha(m.alpha)}
    out = {k: _copy(v) for k, v in t.items()}
    if "lokr_t2" in t:  # ComfyUI's kron fails on its CP w2 (Comfy-Org/ComfyUI#11245): write it flat
        out.pop("lokr_t2")
        out["lokr_w2_a"], out["lokr_w2_b"] = lokr_flat_w2(t["lokr_t2"], t["lokr_w2_a"], t["lokr_w2_b"])
    if "lokr_w1" in t and "lokr_w2" in t:
        # Both factors full: ComfyUI's LoKrAdapter uses scale 1 and ignores .alpha; fold peft's alpha / r.
        out["lokr_w1"] = (_f(t["lokr_w1"]) * m.scaling).to(t["lokr_w1"].dtype).contiguous()
        return out
    # ComfyUI: alpha / dim with dim = lokr_w2_b.shape[0], else lokr_w1_b.shape[0]; both are r (checked).
    out["alpha"] = _alpha(m.alpha)
    return out


def dora_scale(m: Module, base_weight: Tensor | None) -> Tensor:
    """The output-axis ``dora_scale`` for ComfyUI's ``weight_decompose``: ``m · (‖W0‖ + eps) / ‖W0 + sΔ‖``.

    Shaped (out, 1) for Linear, (out, 1, 1, 1) for Conv; fp32 (fp64 if the base weight is fp64).
    Computed in fp64 from fp32 values, so the only error left is ComfyUI's own fp32 rounding.
    """
    if m.kind != "dora":
        raise ImgloraError(f"{m.name}: only DoRA has a dora_scale, this is {m.kind}")
    if base_weight is None:
        raise ImgloraError(f"{m.name}: exporting DoRA for ComfyUI needs the module's base weight: ComfyUI divides "
                           "by the norm of the original weight, peft by the norm of the merged one, and the "
                           "exported dora_scale is compensated for that (imglora.adapters.forms docstring)")
    out_dtype = torch.float64 if base_weight.dtype == torch.float64 else torch.float32
    w0 = base_weight.detach().to(torch.float32).to(torch.float64)  # the fp32 weight ComfyUI patches
    d = (_unscaled(m).double() * m.scaling).reshape(_target_shape(m, base_weight))
    mag = _f(m.tensors["lora_magnitude_vector"]).double().reshape(w0.shape[0], *[1] * (w0.dim() - 1))
    scale = mag * (_row_norm(w0) + COMFY_EPS) / _row_norm(w0 + d)
    return scale.to(out_dtype).contiguous()


def lokr_flat_w2(t2: Tensor, w2_a: Tensor, w2_b: Tensor) -> tuple[Tensor, Tensor]:
    """peft's CP factor ``w2[p, q, k, l] = Σ_ij t2[i, j, k, l] · w2_a[i, p] · w2_b[j, q]`` as the same-rank
    flat pair ``(out_k, r) @ (r, in_n·kh·kw)`` that peft and ComfyUI use without the CP form.

    Exact in real arithmetic (w2_a transposed; w2_b absorbs t2); computed in fp64, returned in
    w2_b's dtype. Needed because ComfyUI's LoKrAdapter feeds the einsum's non-contiguous result to
    ``torch.kron``, which raises "view size is not compatible …" (torch 2.13, as in
    Comfy-Org/ComfyUI#11245): ComfyUI logs an ERROR and leaves such layers unpatched.
    """
    r = t2.shape[0]
    a = w2_a.detach().double().t()                                                  # (out_k, r)
    b = torch.einsum("i j k l, j q -> i q k l", t2.detach().double(), w2_b.detach().double()).reshape(r, -1)
    return a.to(w2_a.dtype).contiguous(), b.to(w2_b.dtype).contiguous()

"""LoKr (LyCORIS' Kronecker product, peft ``LoKrConfig``): ``ΔW = (alpha / r) · w1 ⊗ w2``, each factor
full or low-rank (``lokr_w1`` or ``lokr_w1_a``/``lokr_w1_b``; ``lokr_w2`` or ``lokr_w2_a``/``lokr_w2_b``,
with the CP form ``lokr_t2`` on k×k Conv2d layers).

ComfyUI's form (``comfy/weight_adapter/lokr.py``): the tensors as they are, plus ``alpha`` when at
least one factor is low-rank (ComfyUI's dim: ``lokr_w2_b.shape[0]``, else ``lokr_w1_b.shape[0]``,
both r). When both factors are full matrices ComfyUI ignores ``.alpha`` (scale 1) while peft still
scales by ``alpha / r``, so the scale is folded into ``lokr_w1`` and no ``.alpha`` is written. The
CP form (``lokr_t2`` with ``lokr_w2_a (r, out_k)``, ``lokr_w2_b (r, in_n)``) is rewritten as the
equivalent flat pair ``lokr_w2_a (out_k, r)``, ``lokr_w2_b (r, in_n·kh·kw)`` of the same rank:
ComfyUI's LoKrAdapter hands the CP einsum's non-contiguous result to ``torch.kron``, which raises
(Comfy-Org/ComfyUI#11245) and leaves the layer unpatched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .kind import Kind, Module, alpha_tensor, copy, cp, f32, fail, lycoris_common, lycoris_metadata, need, target_shape

if TYPE_CHECKING:
    from ..config import LoraConfig


class Lokr(Kind):
    name, label, peft_type, prefix = "lokr", "LoKr", "LOKR", "lokr_"
    suffixes = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
    keys = {"rank_dropout": "dropout", "module_dropout": "dropout", "effective_conv2d": None, "factor": None,
            "decompose_both": None}

    def peft_config(self, s: "LoraConfig", targets: str | list[str]) -> Any:
        from peft import LoKrConfig

        return LoKrConfig(**lycoris_common(s, targets), decompose_both=s.decompose_both, decompose_factor=s.factor)

    def problems(self, lo: "LoraConfig", where: Any) -> list[str]:
        if lo.block_ranks:
            return [f"{where('lora.block_ranks')}: LoKr's rank is of its factors; set lora.rank for every block"]
        return []

    def check_tensors(self, m: Module) -> None:
        t = m.tensors
        if "lokr_w1" in t and ("lokr_w1_a" in t or "lokr_w1_b" in t):
            fail(m, "lokr_w1 is either full (lokr_w1) or low-rank (lokr_w1_a, lokr_w1_b)")
        if "lokr_w2" in t and ("lokr_w2_a" in t or "lokr_w2_b" in t or "lokr_t2" in t):
            fail(m, "lokr_w2 is either full (lokr_w2) or low-rank (lokr_w2_a, lokr_w2_b[, lokr_t2])")
        if "lokr_w1" not in t:
            need(m, "lokr_w1_a", "lokr_w1_b")
            a, b = t["lokr_w1_a"], t["lokr_w1_b"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or b.shape[0] != m.rank:
                fail(m, f"lokr_w1_a (a, r) and lokr_w1_b (r, c) with r = {m.rank}")
        elif t["lokr_w1"].dim() != 2:
            fail(m, "lokr_w1 must be 2-D")
        if "lokr_w2" not in t:
            need(m, "lokr_w2_a", "lokr_w2_b")
            a, b = t["lokr_w2_a"], t["lokr_w2_b"]
            if "lokr_t2" in t:
                t2 = t["lokr_t2"]
                ok = t2.dim() == 4 and a.dim() == b.dim() == 2 and t2.shape[0] == a.shape[0] == m.rank \
                    and t2.shape[1] == b.shape[0] == m.rank
            else:
                ok = a.dim() == b.dim() == 2 and a.shape[1] == b.shape[0] == m.rank
            if not ok:
                fail(m, f"lokr_w2_a/lokr_w2_b (and lokr_t2) must share rank {m.rank}")
        elif t["lokr_w2"].dim() not in (2, 4):
            fail(m, "lokr_w2 must be 2-D or 4-D")

    def natural_shape(self, m: Module) -> tuple[int, ...]:
        """Flat (out, in·kh·kw) on Conv2d without the CP form, like a Linear: only the base weight tells them apart."""
        t = m.tensors
        w1 = t["lokr_w1"].shape if "lokr_w1" in t else (t["lokr_w1_a"].shape[0], t["lokr_w1_b"].shape[1])
        if "lokr_w2" in t:
            w2 = tuple(t["lokr_w2"].shape)
        elif "lokr_t2" in t:
            w2 = (t["lokr_w2_a"].shape[1], t["lokr_w2_b"].shape[1], *t["lokr_t2"].shape[2:])
        else:
            w2 = (t["lokr_w2_a"].shape[0], t["lokr_w2_b"].shape[1])
        return (w1[0] * w2[0], w1[1] * w2[1], *w2[2:])

    def unscaled(self, m: Module) -> Tensor:
        t = m.tensors
        w1 = f32(t["lokr_w1"]) if "lokr_w1" in t else f32(t["lokr_w1_a"]) @ f32(t["lokr_w1_b"])
        if "lokr_w2" in t:
            w2 = f32(t["lokr_w2"])
        elif "lokr_t2" in t:
            w2 = cp(t["lokr_t2"], t["lokr_w2_a"], t["lokr_w2_b"])
        else:
            w2 = f32(t["lokr_w2_a"]) @ f32(t["lokr_w2_b"])
        if w2.dim() == 4:
            w1 = w1[:, :, None, None]
        return torch.kron(w1, w2.contiguous())  # as peft's make_kron: kron needs a contiguous CP factor

    def comfy_tensors(self, m: Module, base_weight: Tensor | None) -> dict[str, Tensor]:
        t = m.tensors
        if base_weight is not None:
            target_shape(m, base_weight)
        out = {k: copy(v) for k, v in t.items()}
        if "lokr_t2" in t:  # ComfyUI's kron fails on its CP w2 (Comfy-Org/ComfyUI#11245): write it flat
            out.pop("lokr_t2")
            out["lokr_w2_a"], out["lokr_w2_b"] = flat_w2(t["lokr_t2"], t["lokr_w2_a"], t["lokr_w2_b"])
        if "lokr_w1" in t and "lokr_w2" in t:
            # Both factors full: ComfyUI's LoKrAdapter uses scale 1 and ignores .alpha; fold peft's alpha / r.
            out["lokr_w1"] = (f32(t["lokr_w1"]) * m.scaling).to(t["lokr_w1"].dtype).contiguous()
            return out
        out["alpha"] = alpha_tensor(m.alpha)
        return out

    def metadata(self, lo: "LoraConfig") -> dict[str, Any]:
        return lycoris_metadata("lokr", lo, factor=str(lo.factor), decompose_both=str(lo.decompose_both))


def flat_w2(t2: Tensor, w2_a: Tensor, w2_b: Tensor) -> tuple[Tensor, Tensor]:
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


LOKR = Lokr()

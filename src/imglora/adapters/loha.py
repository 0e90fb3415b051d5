"""LoHa (LyCORIS' Hadamard product, peft ``LoHaConfig``): ``ΔW = (alpha / r) · (w1_a w1_b) ⊙ (w2_a w2_b)``,
or with the CP (Tucker) form on k×k Conv2d layers (``use_effective_conv2d``, ``hada_t1``/``hada_t2``).

ComfyUI's form (``comfy/weight_adapter/loha.py``): the tensors as peft holds them (same shapes, the
same CP einsum) plus ``alpha``; ComfyUI scales by ``alpha / hada_w1_b.shape[0]``, and ``hada_w1_b``
has r rows in the plain and in the CP layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from .kind import Kind, Module, alpha_tensor, copy, cp, f32, fail, lycoris_common, lycoris_metadata, need, target_shape

if TYPE_CHECKING:
    from ..config import LoraConfig


class Loha(Kind):
    name, label, peft_type, prefix = "loha", "LoHa", "LOHA", "hada_"
    suffixes = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")
    keys = {"rank_dropout": "dropout", "module_dropout": "dropout", "effective_conv2d": None}

    def peft_config(self, s: "LoraConfig", targets: str | list[str]) -> Any:
        from peft import LoHaConfig

        return LoHaConfig(**lycoris_common(s, targets))

    def check_tensors(self, m: Module) -> None:
        t = m.tensors
        need(m, "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
        if ("hada_t1" in t) != ("hada_t2" in t):
            fail(m, "hada_t1 and hada_t2 come together")
        for i in "12":
            wa, wb = t[f"hada_w{i}_a"], t[f"hada_w{i}_b"]
            if f"hada_t{i}" in t:
                tt = t[f"hada_t{i}"]
                ok = tt.dim() == 4 and wa.dim() == wb.dim() == 2 and tt.shape[0] == wa.shape[0] == m.rank \
                    and tt.shape[1] == wb.shape[0] == m.rank
            else:
                ok = wa.dim() == wb.dim() == 2 and wa.shape[1] == wb.shape[0] == m.rank
            if not ok:
                fail(m, f"hada_w{i}_a/hada_w{i}_b (and hada_t{i}) must share rank {m.rank}")
        if _factor_shape(m, "1") != _factor_shape(m, "2"):
            fail(m, "the two Hadamard factors must have the same shape")

    def natural_shape(self, m: Module) -> tuple[int, ...]:
        """Flat (out, in·kh·kw) on Conv2d without the CP form, like a Linear: only the base weight tells them apart."""
        return _factor_shape(m, "1")

    def unscaled(self, m: Module) -> Tensor:
        t = m.tensors
        if "hada_t1" in t:
            return cp(t["hada_t1"], t["hada_w1_a"], t["hada_w1_b"]) * cp(t["hada_t2"], t["hada_w2_a"], t["hada_w2_b"])
        return (f32(t["hada_w1_a"]) @ f32(t["hada_w1_b"])) * (f32(t["hada_w2_a"]) @ f32(t["hada_w2_b"]))

    def comfy_tensors(self, m: Module, base_weight: Tensor | None) -> dict[str, Tensor]:
        if base_weight is not None:
            target_shape(m, base_weight)
        return {**{k: copy(v) for k, v in m.tensors.items()}, "alpha": alpha_tensor(m.alpha)}

    def metadata(self, lo: "LoraConfig") -> dict[str, Any]:
        return lycoris_metadata("loha", lo)


def _factor_shape(m: Module, i: str) -> tuple[int, ...]:
    t = m.tensors
    if f"hada_t{i}" in t:
        tt = t[f"hada_t{i}"]
        return (t[f"hada_w{i}_a"].shape[1], t[f"hada_w{i}_b"].shape[1], *tt.shape[2:])
    return (t[f"hada_w{i}_a"].shape[0], t[f"hada_w{i}_b"].shape[1])


LOHA = Loha()

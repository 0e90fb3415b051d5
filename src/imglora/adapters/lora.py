"""LoRA (peft ``LoraConfig``): ``W' = W + (alpha / r) · B A``, B starting at zero.

ComfyUI's form (``comfy/weight_adapter/lora.py``): ``lora_up.weight = lora_B``, ``lora_down.weight =
lora_A``, ``alpha = scaling · r`` (ComfyUI scales by ``alpha / rank`` with rank = rows of
``lora_down``; peft by ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA, so rsLoRA's alpha is
written as ``scaling · r``). peft's ``lora_bias`` has no ComfyUI form and is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .kind import Kind, Module, alpha_tensor, copy, f32, fail, need, target_shape

if TYPE_CHECKING:
    from ..config import LoraConfig


class Lora(Kind):
    name, label, peft_type, prefix = "lora", "LoRA", "LORA", "lora_"
    suffixes = ("lora_A.weight", "lora_B.weight")
    keys = {"dropout": "dropout", "loraplus_lr_ratio": None}
    rslora = True
    alpha_key = "lora_alpha"

    def peft_config(self, s: "LoraConfig", targets: str | list[str]) -> Any:
        from peft import LoraConfig

        return LoraConfig(r=s.rank, lora_alpha=s.alpha, lora_dropout=s.dropout, target_modules=targets,
                          init_lora_weights=True, use_dora=self.name == "dora")

    def is_peft_config(self, meta: Any) -> bool:
        return super().is_peft_config(meta) and bool(meta.get("use_dora")) == (self.name == "dora")

    def check_tensors(self, m: Module) -> None:
        need(m, *self.suffixes)
        a, b = m.tensors["lora_A.weight"], m.tensors["lora_B.weight"]
        if a.dim() not in (2, 4) or b.dim() != a.dim() or b.shape[1] != a.shape[0] or b.shape[2:] not in (
                torch.Size(), torch.Size([1, 1])):
            fail(m, "lora_B must be (out, r[, 1, 1]) and lora_A (r, in[, kh, kw])")
        if a.shape[0] != m.rank:
            fail(m, f"rank {m.rank} given, lora_A has {a.shape[0]} rows; pass the module's rank_pattern rank")

    def natural_shape(self, m: Module) -> tuple[int, ...]:
        a, b = m.tensors["lora_A.weight"], m.tensors["lora_B.weight"]
        return (b.shape[0], *a.shape[1:])

    def unscaled(self, m: Module) -> Tensor:
        a, b = f32(m.tensors["lora_A.weight"]), f32(m.tensors["lora_B.weight"])
        return (b.flatten(1) @ a.flatten(1)).reshape(b.shape[0], *a.shape[1:])

    def comfy_tensors(self, m: Module, base_weight: Tensor | None) -> dict[str, Tensor]:
        if base_weight is not None:
            target_shape(m, base_weight)
        # ComfyUI: alpha / lora_down.shape[0] == alpha / r; peft: scaling (alpha / r, or alpha / sqrt(r)).
        return {"lora_up.weight": copy(m.tensors["lora_B.weight"]), "lora_down.weight": copy(m.tensors["lora_A.weight"]),
                "alpha": alpha_tensor(m.alpha if not m.use_rslora else m.scaling * m.rank)}


LORA = Lora()

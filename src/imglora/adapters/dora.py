"""DoRA (peft ``LoraConfig(use_dora=True)``): LoRA plus a trained magnitude per output row.

peft's magnitude ``m`` (Linear ``(out,)``, Conv ``(1, out, 1, 1)``) gives ``W' = m / ‖W0 + sΔ‖_row ·
(W0 + sΔ)``, the norm per output row of the MERGED weight, no eps
(``peft/tuners/lora/variants.py::DoraLinearVariant.merge_safe``). ComfyUI's ``weight_decompose``
(``comfy/weight_adapter/base.py``) takes a ``dora_scale`` whose first dimension equals the weight's
as output-axis and computes ``W' = (W0 + sΔ) · dora_scale / (‖W0‖_row + eps)``: it divides by the
norm of the ORIGINAL weight (eps = ``torch.finfo(float32).eps`` in its normal fp32 patching). So
the exported value is compensated,

    dora_scale = m · (‖W0‖_row + eps) / ‖W0 + sΔ‖_row,   shaped (out, 1) / (out, 1, 1, 1)

which needs the base weight (as ComfyUI will hold it: the checkpoint's weight in fp32; for FLUX
q/k/v the module's own weight, which is the row slice ComfyUI narrows to). Never 1-D: a ``(out,)``
scale broadcasts to ``(out, out)`` in ComfyUI (Comfy-Org/ComfyUI#12938), which is silently wrong
for square weights and leaves other weights unpatched.

Caveats: the open ComfyUI PR #15458 ("fix: normalize output-axis DoRA with adapted weights") would
divide by ``‖W0 + sΔ‖`` instead; if it lands, these files scale each output row by
``(‖W0‖ + eps) / ‖W0 + sΔ‖`` too much, and the plain magnitude ``m`` becomes the exact value.
ComfyUI's low-VRAM path (``model_patcher.LowVramPatch``) patches in the weight's own dtype, so its
eps is that dtype's (bf16: 2**-7); the compensation assumes fp32 patching. The magnitude is per
output row, so fusing q/k/v rows into one qkv weight keeps it exact, but a ``function`` that
permutes rows (FLUX ``norm_out``'s scale/shift swap) is applied to the delta and not to
``dora_scale``: the exporter has to permute ``dora_scale`` itself there. diffusers'
``load_lora_weights`` drops kohya ``dora_scale`` keys and reads only peft's ``lora_magnitude_vector``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..errors import ImgloraError
from .kind import COMFY_EPS, Module, f32, fail, row_norm, target_shape
from .lora import Lora

if TYPE_CHECKING:
    from ..config import LoraConfig


class Dora(Lora):
    name, label = "dora", "DoRA"
    suffixes = ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector")
    needs_base_weight = True

    def check_tensors(self, m: Module) -> None:
        super().check_tensors(m)
        if m.tensors["lora_magnitude_vector"].numel() != m.tensors["lora_B.weight"].shape[0]:
            fail(m, "the DoRA magnitude needs one value per output row")

    def delta(self, m: Module, base_weight: Tensor | None) -> Tensor:
        """``m / ‖W0 + sΔ‖_row · (W0 + sΔ) − W0``, as peft's ``merge``."""
        d = super().delta(m, base_weight)
        if base_weight is None:
            raise ImgloraError(f"{m.name}: a DoRA delta depends on the base weight; pass base_weight")
        w0 = f32(base_weight).to(d.dtype)
        merged = w0 + d
        mag = f32(m.tensors["lora_magnitude_vector"]).reshape(merged.shape[0], *[1] * (merged.dim() - 1))
        return mag / row_norm(merged) * merged - w0

    def comfy_tensors(self, m: Module, base_weight: Tensor | None) -> dict[str, Tensor]:
        return {**super().comfy_tensors(m, base_weight), "dora_scale": dora_scale(m, base_weight)}

    def metadata(self, lo: "LoraConfig") -> dict[str, Any]:
        return {"ss_network_args": json.dumps({"dora_wd": "True"})}  # kohya's DoRA


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
                           "exported dora_scale is compensated for that (imglora.adapters.dora docstring)")
    out_dtype = torch.float64 if base_weight.dtype == torch.float64 else torch.float32
    w0 = base_weight.detach().to(torch.float32).to(torch.float64)  # the fp32 weight ComfyUI patches
    d = (DORA.unscaled(m).double() * m.scaling).reshape(target_shape(m, base_weight))
    mag = f32(m.tensors["lora_magnitude_vector"]).double().reshape(w0.shape[0], *[1] * (w0.dim() - 1))
    scale = mag * (row_norm(w0) + COMFY_EPS) / row_norm(w0 + d)
    return scale.to(out_dtype).contiguous()


DORA = Dora()

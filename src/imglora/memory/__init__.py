"""Memory features that wrap a model without knowing its family.

- :mod:`.fp8`: frozen Linear weights stored in fp8 (optimum-quanto), LoRA left in high precision.
- :mod:`.swap`: frozen weights of chosen blocks streamed from pinned host memory into a few
  reusable GPU buffers, overlapped with compute.

Call order when both are used: inject LoRA -> ``quantize_fp8`` -> ``BlockSwapper.install`` ->
build the optimizer; each step ``swapper.prepare_forward()`` before the forward.
"""

from .fp8 import Fp8Report, quantize_fp8, tensor_bytes, to_device, weight_bytes
from .swap import BlockSwapper, PoolStats, SwapEvent, SwapStats, swap_mask

__all__ = [
    "BlockSwapper",
    "Fp8Report",
    "PoolStats",
    "SwapEvent",
    "SwapStats",
    "quantize_fp8",
    "swap_mask",
    "tensor_bytes",
    "to_device",
    "weight_bytes",
]

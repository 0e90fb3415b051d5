"""``memory.compile = "blocks"``: regional compilation of the transformer blocks with ``torch.compile``.

Every module of a class the family names in ``compile_blocks`` gets its ``forward`` compiled: FLUX's
double and single blocks, SDXL's transformer and ResNet blocks. The blocks of one class share their
code, and their parameters are inputs to the graph, not constants in it. So dynamo compiles one
graph per kind of block, and not one per block: FLUX.1-dev's 57 blocks compile two graphs, forward
and backward. This is diffusers' "regional compilation", and it is what musubi-tuner's ``--compile``
and OneTrainer's compiled blocks do. Inductor fuses the memory-bound work between the matmuls
(norms, modulation, GELU, RoPE, casts, LoRA's scaling) into fewer kernels.

Only ``forward`` is compiled, not the module call. The hooks around it stay outside the graph and
run eagerly, as before: the swap engine's loads and evictions, offloaded checkpoint boundaries, and
the gradient-checkpointing wrapper that the model puts around each block call.

* **fp8 weights.** quanto's fp8 linear dispatches on its tensor subclass, which dynamo cannot compile
  (its graph outputs alias a subclass). Under compilation each fp8 layer gets a forward of the same
  math on the subclass's inner tensors instead: ``scale * data`` in the scale's dtype, then the
  matmul, as quanto's ``qbytes_mm`` computes it, with the bias added in the matmul. Inductor's
  partitioner then decides per layer whether backward keeps the dequantized weight or recomputes
  it from the fp8 bytes. fp8 compute (``memory.fp8_compute``) keeps ``torch._scaled_mm``; its
  fallback calls take this forward too.
* **Shapes.** The first update at a new bucket shape compiles again. From the second shape on,
  dynamo marks the changing sizes dynamic ("automatic dynamic shapes"), and one graph serves the
  rest.
* **Cost.** The first update pays for the compilation. On 2 CPU cores this is 40–50 s for the tiny
  FLUX with a cold inductor cache and 6–8 s with a warm one (measured). On a GPU it has not been
  measured yet. ``bench-swap`` reports it (``first_update_seconds``, ``compile_seconds``).
* **Checkpoints.** Only the ``forward`` attribute changes, so state dicts, adapters and checkpoints
  have the same keys with and without compilation. A run can resume with it turned on or off.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch import nn


def blocks_to_compile(model: nn.Module, family: Any) -> list[nn.Module]:
    """The modules whose forward is compiled: those of a class named in ``family.compile_blocks``."""
    kinds = set(getattr(family, "compile_blocks", ()))
    return [m for m in model.modules() if type(m).__name__ in kinds]


def dequantizing_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """An fp8 (qfloat8) QLinear's forward as quanto computes it, on the weight's inner tensors (a
    graph dynamo can trace): the weight times its per-channel scale, in the scale's dtype, then
    the matmul; the bias added in the matmul rather than after it."""
    w = self.weight
    scale = w._scale
    weight = scale * w._data.to(scale.dtype)
    return torch.nn.functional.linear(input.to(scale.dtype), weight, self.bias)


def traceable_fp8(model: nn.Module) -> int:
    """Give each fp8 QLinear of ``model`` :func:`dequantizing_forward`. A layer that fp8 compute took
    keeps its ``torch._scaled_mm`` forward; its fallback calls take this one. Returns the layers
    changed."""
    from optimum.quanto import qfloat8
    from optimum.quanto.nn import QLinear

    n = 0
    for mod in model.modules():
        if isinstance(mod, QLinear) and getattr(mod, "weight_qtype", None) == qfloat8:
            if hasattr(mod, "_fp8_compute"):
                mod._fp8_fallback = types.MethodType(dequantizing_forward, mod)
                # Its autograd function saves the subclass's inner tensors for backward, which dynamo
                # cannot compile (they alias a subclass input): the layer runs eagerly, between graphs.
                mod.forward = torch.compiler.disable(mod.forward)
            else:
                mod.forward = types.MethodType(dequantizing_forward, mod)
            n += 1
    return n


def eager_dora(model: nn.Module) -> int:
    """DoRA layers on fp8 weights run eagerly, between graphs: peft's DoRA takes the norm of the
    dequantized base weight through quanto's subclass, which dynamo cannot compile. Returns the
    layers left out."""
    from optimum.quanto.nn import QModuleMixin
    from peft.tuners.lora import LoraLayer

    n = 0
    for mod in model.modules():
        if isinstance(mod, LoraLayer) and any(mod.use_dora.values()) and isinstance(mod.get_base_layer(), QModuleMixin):
            mod.forward = torch.compiler.disable(mod.forward)
            n += 1
    return n


def toolchain_problem(device: torch.device) -> str | None:
    """What inductor lacks to compile for ``device`` on this machine, or None: a C++ compiler for
    the CPU; triton and a C compiler (for triton's launcher) for CUDA."""
    import os
    import shutil

    from ..devices import is_cuda

    if is_cuda(device) and device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch.compile on CUDA needs triton, which this torch install lacks (pip install triton)"
        if not any(shutil.which(c) for c in (os.environ.get("CC", ""), "cc", "gcc", "clang") if c):
            return "triton needs a C compiler to build its launcher, and none is on PATH (apt install gcc)"
        return None
    if not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c):
        return "torch.compile on the CPU needs a C++ compiler, and none is on PATH (apt install g++)"
    return None


def install(model: nn.Module, family: Any, mode: str, device: torch.device,
            out: Callable[[str], None]) -> dict[str, Any]:
    """Compile the forward of each block ``family.compile_blocks`` names (see the module docstring);
    returns the facts for the run record. Refuses, before any compilation, a machine that cannot
    compile."""
    from ..errors import ImgloraError

    problem = toolchain_problem(device)
    if problem:
        raise ImgloraError(f"memory.compile = \"blocks\": {problem}; or set memory.compile = \"none\"")
    blocks = blocks_to_compile(model, family)
    quanto = _has_quanto(model)
    fp8_layers = traceable_fp8(model) if quanto else 0
    eager = eager_dora(model) if quanto else 0
    eager += sum(1 for m in model.modules() if hasattr(m, "_fp8_fallback"))
    options: dict[str, Any] = {} if mode == "default" else {"mode": mode}
    for block in blocks:
        block.forward = torch.compile(block.forward, **options)
    kinds: dict[str, int] = {}
    for block in blocks:
        kinds[type(block).__name__] = kinds.get(type(block).__name__, 0) + 1
    out(f"compiled blocks: {', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))} (torch.compile, mode "
        f"{mode}, one graph per kind); the first update compiles them"
        + (f"; {fp8_layers - eager} fp8 layers dequantize in the graph" if fp8_layers - eager > 0 else "")
        + (f"; {eager} layers run eagerly between graphs (fp8 compute, DoRA on fp8)" if eager else ""))
    return {"blocks": len(blocks), "kinds": kinds, "mode": mode, "fp8_layers_in_graph": fp8_layers - eager,
            "eager_layers": eager}


def graphs() -> dict[str, int]:
    """dynamo's counts so far in this process: graphs compiled, and recompilations (a new bucket
    shape, a guard that failed): for the run record."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "recompiles": int(sum(counters["recompiles"].values()))}


def _has_quanto(model: nn.Module) -> bool:
    try:
        from optimum.quanto.nn import QModuleMixin
    except ImportError:
        return False
    return any(isinstance(m, QModuleMixin) for m in model.modules())

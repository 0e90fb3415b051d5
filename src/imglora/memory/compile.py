"""``memory.compile = "blocks"``: regional compilation of the transformer blocks with ``torch.compile``.

Every module of a class the family names in ``compile_blocks`` gets its ``forward`` compiled: FLUX's
double and single blocks, SDXL's transformer and ResNet blocks. The blocks of one class share their
code, and their parameters are inputs to the graph, not constants in it. So dynamo compiles one
graph per kind and shape of block, not one per block: FLUX.1-dev's 57 blocks compile two forward
graphs (and their backward). SDXL's blocks come in several widths, one graph each. This is diffusers' "regional compilation", and it is what musubi-tuner's ``--compile``
and OneTrainer's compiled blocks do. Inductor fuses the memory-bound work between the matmuls
(norms, modulation, GELU, RoPE, casts, LoRA's scaling) into fewer kernels.

Only ``forward`` is compiled, not the module call. The hooks around it stay outside the graph and
run eagerly, as before: the swap engine's loads and evictions, offloaded checkpoint boundaries, and
the gradient-checkpointing wrapper that the model puts around each block call.

* **fp8 weights.** quanto's fp8 linear dispatches on its tensor subclass, which dynamo cannot compile
  (its graph outputs alias a subclass). Under compilation each fp8 layer of a compiled block gets
  a forward of the same math on the subclass's inner tensors instead: ``scale * data`` in the
  scale's dtype, then the matmul, as quanto's ``qbytes_mm`` computes it, with the bias added in the
  matmul. Inductor's partitioner then decides per layer whether backward keeps the dequantized
  weight or recomputes it from the fp8 bytes, and fuses the cast and the scaling into one kernel:
  inside the graphs this is what ``memory.fp8_fused`` does eagerly, which so only changes the fp8
  layers outside compiled blocks (``fp8f+compile`` measures the same graphs as ``fp8+compile``). fp8 compute's layers (``memory.fp8_compute``) and the
  fp8 bases of DoRA adapters run eagerly between graphs, unchanged (:func:`prepare_fp8`).
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

from ..family import option


def blocks_to_compile(model: nn.Module, family: Any) -> list[nn.Module]:
    """The modules whose forward is compiled: those of a class named in ``family.compile_blocks``."""
    kinds = set(option(family, "compile_blocks"))
    return [m for m in model.modules() if type(m).__name__ in kinds]


def dequantizing_forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """An fp8 (qfloat8) QLinear's forward as quanto computes it, on the weight's inner tensors (a
    graph dynamo can trace): the weight times its per-channel scale, in the scale's dtype, then
    the matmul; the bias added in the matmul rather than after it."""
    w = self.weight
    scale = w._scale
    weight = scale * w._data.to(scale.dtype)
    return torch.nn.functional.linear(input.to(scale.dtype), weight, self.bias)


def _fp8_layers(module: nn.Module) -> list[nn.Module]:
    """The fp8 (qfloat8) QLinear layers in ``module``."""
    from optimum.quanto import qfloat8
    from optimum.quanto.nn import QLinear

    return [m for m in module.modules() if isinstance(m, QLinear) and getattr(m, "weight_qtype", None) == qfloat8]


def prepare_fp8(blocks: list[nn.Module]) -> tuple[int, int]:
    """The fp8 layers inside the compiled ``blocks``, made traceable: each gets
    :func:`dequantizing_forward`, except those dynamo cannot compile, which run eagerly between
    graphs (``torch.compiler.disable``) with their forward unchanged:

    * fp8 compute's layers: their autograd function saves the subclass's inner tensors for
      backward, aliases of a subclass input that dynamo cannot compile;
    * the base layers of DoRA adapters: peft's DoRA takes the norm of the dequantized weight
      through quanto's subclass (the whole DoRA layer runs eagerly).

    Returns (layers in the graphs, layers run eagerly); each layer is counted once."""
    from peft.tuners.lora import LoraLayer

    eager: set[int] = set()
    for block in blocks:
        for mod in block.modules():
            if isinstance(mod, LoraLayer) and any(mod.use_dora.values()) and _fp8_layers(mod.get_base_layer()):
                mod.forward = torch.compiler.disable(mod.forward)
                eager.update(id(m) for m in _fp8_layers(mod.get_base_layer()))
    in_graph = 0
    for block in blocks:
        for mod in _fp8_layers(block):
            if hasattr(mod, "_fp8_compute"):
                mod.forward = torch.compiler.disable(mod.forward)
                eager.add(id(mod))
            elif id(mod) not in eager:
                mod.forward = types.MethodType(dequantizing_forward, mod)
                in_graph += 1
    return in_graph, len(eager)


RECOMPILE_LIMIT = 64  # graphs dynamo keeps per code object before it runs the code eagerly


def _allow_recompiles() -> None:
    """SDXL's blocks of one class differ in width (320 to 1280 channels) and in whether a ResNet
    block has a shortcut: each variant is a graph of its own, and dynamo's default limit (8 per code
    object) would leave the rest eager, silently. Raised to RECOMPILE_LIMIT."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):  # (the newer name, then the older)
        try:
            current = getattr(dynamo_config, name)
        except AttributeError:
            continue
        setattr(dynamo_config, name, max(current, RECOMPILE_LIMIT))
        return


def toolchain_problem(device: torch.device) -> str | None:
    """What inductor lacks to compile for ``device`` on this machine, or None: a C++ compiler for
    the CPU; triton and a C compiler (for triton's launcher) for CUDA."""
    import os
    import shutil

    from ..util.devices import is_cuda

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


def require_toolchain(device: torch.device) -> None:
    """Refuse, with what to install, a machine where inductor cannot compile for ``device``."""
    from ..errors import ImgloraError

    problem = toolchain_problem(device)
    if problem:
        raise ImgloraError(f"memory.compile = \"blocks\": {problem}; or set memory.compile = \"none\"")


def install(model: nn.Module, family: Any, mode: str, device: torch.device,
            out: Callable[[str], None]) -> dict[str, Any]:
    """Compile the forward of each block ``family.compile_blocks`` names (see the module docstring);
    returns the facts for the run record. Refuses, before any compilation, a machine that cannot
    compile."""
    require_toolchain(device)
    blocks = blocks_to_compile(model, family)
    in_graph, eager = prepare_fp8(blocks) if _has_quanto(model) else (0, 0)
    _allow_recompiles()
    options: dict[str, Any] = {} if mode == "default" else {"mode": mode}
    for block in blocks:
        block.forward = torch.compile(block.forward, **options)
    kinds: dict[str, int] = {}
    for block in blocks:
        kinds[type(block).__name__] = kinds.get(type(block).__name__, 0) + 1
    out(f"compiled blocks: {', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))} (torch.compile, mode "
        f"{mode}; blocks of one kind and shape share a graph); the first update compiles them"
        + (f"; {in_graph} fp8 layers dequantize in the graphs" if in_graph else "")
        + (f"; {eager} fp8 layers run eagerly between graphs (fp8 compute, DoRA on fp8)" if eager else ""))
    return {"blocks": len(blocks), "kinds": kinds, "mode": mode, "fp8_layers_in_graph": in_graph,
            "eager_layers": eager}


def graphs() -> dict[str, int]:
    """dynamo's counts so far in this process, for the run record: the graphs compiled (each kind
    and shape of block, forward; a new bucket shape adds one) and the frames it compiled."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "frames_compiled": int(counters["frames"].get("ok", 0))}


def _has_quanto(model: nn.Module) -> bool:
    try:
        from optimum.quanto.nn import QModuleMixin
    except ImportError:
        return False
    return any(isinstance(m, QModuleMixin) for m in model.modules())

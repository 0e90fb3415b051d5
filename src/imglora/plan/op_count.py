"""Every kernel a training step launches, with its FLOPs and the bytes it moves (``imglora plan``'s time).

:class:`OpCounter` is a ``TorchDispatchMode`` that runs beside :class:`~imglora.plan.meter.LiveBytes`
in the meta-device step of ``imglora.plan``: the family's own loss, forward, gradient-checkpoint
recompute and backward, op by op as the autograd engine dispatches them. For each op it records:

* **FLOPs**: torch's own formulas (``torch.utils.flop_counter``) for matrix products and
  convolutions; attention (the fused kernel ``memory.meta_run`` stands in with) is counted as a
  flash kernel does its work: 4·B·H·Nq·Nk·D forward, 10·B·H·Nq·Nk·D backward (the score matrix
  recomputed, then four products).
* **Bytes**: every tensor the op reads and the tensor it writes, at their viewed sizes. Views cost
  nothing and launch nothing; allocations without a fill are not kernels.
* **What it is**: a product with a frozen base weight of a LoRA layer (the matmuls fp8 dequantizes
  for, or runs in fp8), another product, attention, or memory-bound work (norms, GELU, casts, ...).
* **Where**: forward or backward (a gradient checkpoint's recompute runs inside backward), and the
  swappable block it belongs to: forward ops between a block's forward hooks; under gradient
  checkpointing, backward ops after that block's recompute began, until the next block's.

The records are the kernels of an eager step. A device model (``imglora.plan.timing``) turns them into
seconds.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

OTHER, MATMUL, BASE, ATTENTION = 0, 1, 2, 3  # what an op is
FORWARD, BACKWARD = 0, 1

_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu": 4,
              "_scaled_dot_product_flash_attention_for_cpu_backward": 10}
_NOT_KERNELS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
                "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
                "_has_compatible_shallow_copy_type", "set_", "_unsafe_view"}  # (a view autograd does not track)


_FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}


@dataclass(frozen=True)
class Op:
    kind: int
    phase: int
    block: int  # index into OpTally.blocks, or -1 outside the swappable blocks
    dtype: torch.dtype  # the output's (what a product's tensor cores run in)
    flops: int
    bytes: int
    layer: str = ""  # BASE: the Linear layer whose frozen weight this product uses
    weight: int = 0  # BASE: the frozen weight's elements (what dequantizing touches)
    other: int = 0  # BASE: the other operand's elements (an activation or an output gradient)
    bias: bool = False  # BASE: the bias added inside the product (addmm)
    shape: tuple[int, int, int] = (0, 0, 0)  # BASE: (rows, in features, out features)
    role: str = ""  # BASE: "fwd" (x @ W.t(), forward or recompute) or "dgrad" (the input gradient, g @ W)
    fp8: bool = False  # a product on fp8 tensor cores (torch._scaled_mm)
    from_fp8: bool = False  # memory-bound work reading fp8 data (a dequantizing cast: some CPUs convert slowly)
    name: str = ""  # the aten op ("mm", "native_layer_norm", "_to_copy", ...): where the time goes


@dataclass
class OpTally:
    ops: list[Op] = field(default_factory=list)
    blocks: list[str] = field(default_factory=list)  # "transformer_blocks.3", ...
    layers: dict[str, int] = field(default_factory=dict)  # frozen Linear layers: name -> weight elements


def _nbytes(t: torch.Tensor) -> int:
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _root(t: torch.Tensor) -> torch.Tensor:
    base = t._base
    return t if base is None else base


class OpCounter(TorchDispatchMode):
    """Records an :class:`Op` for each kernel dispatched while it is on (see the module docstring).
    Products with a frozen ``nn.Linear`` weight of ``model`` (the base layers fp8 quantizes) are
    BASE; ``block_containers`` name the swappable block lists."""

    def __init__(self, model: torch.nn.Module, block_containers: list[str], recompute_tags: bool) -> None:
        super().__init__()
        self.tally = OpTally()
        self._weights = {id(m.weight): n for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad}
        self._shapes = {n: tuple(model.get_submodule(n).weight.shape) for n in self._weights.values()}
        self.tally.layers = {n: a * b for n, (a, b) in self._shapes.items()}
        self._block = -1
        self._recompute_tags = recompute_tags
        self._hooks: list[Any] = []
        for container in block_containers:
            for i, blk in enumerate(model.get_submodule(container)):
                self.tally.blocks.append(f"{container}.{i}")
                self._hooks.append(blk.register_forward_pre_hook(self._enter(len(self.tally.blocks) - 1)))
                self._hooks.append(blk.register_forward_hook(self._leave))

    def _enter(self, index: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            self._block = index
        return hook

    def _leave(self, module: Any, args: Any, out: Any) -> None:
        # In backward (a checkpoint's recompute) the block's own backward follows: keep its tag.
        if not (self._recompute_tags and torch._C._current_autograd_node() is not None):
            self._block = -1

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if func.is_view or name in _NOT_KERNELS:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        moved = sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs)
        phase = BACKWARD if torch._C._current_autograd_node() is not None else FORWARD
        dtype = outputs[0].dtype if outputs else (inputs[0].dtype if inputs else torch.float32)
        kind, flops, extra = OTHER, 0, {}
        if any(t.dtype in _FP8 for t in inputs) and outputs and outputs[0].dtype not in _FP8:
            extra["from_fp8"] = True
        if name in _ATTENTION:
            fwd = name.endswith("_cpu")
            q = args[0] if fwd else args[1]
            b, h, nq, d = q.shape
            nk = args[1 if fwd else 2].shape[-2]
            causal = bool(args[4] if fwd else args[7]) if len(args) > (4 if fwd else 7) else False
            kind, flops = ATTENTION, _ATTENTION[name] * b * h * nq * nk * d // (2 if causal else 1)
        else:
            from torch.utils.flop_counter import flop_registry

            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                kind, flops = MATMUL, int(formula(*args, **kwargs, out_val=out))
                extra = {"fp8": name == "_scaled_mm"}
                weight = next((t for t in inputs if id(_root(t)) in self._weights), None)
                if weight is not None and name in ("mm", "addmm") and outputs:
                    layer = self._weights[id(_root(weight))]
                    n_out, n_in = self._shapes[layer]
                    role = "dgrad" if weight.is_contiguous() and tuple(weight.shape) == (n_out, n_in) else "fwd"
                    rows = outputs[0].shape[0]
                    kind = BASE
                    extra.update(layer=layer, weight=n_out * n_in, other=rows * (n_in if role == "fwd" else n_out),
                                 bias=name == "addmm", shape=(rows, n_in, n_out), role=role)
            elif name == "_to_copy" and inputs and id(_root(inputs[0])) in self._weights and outputs:
                # autocast's cast of a frozen weight: the product that uses the copy is that layer's
                key = id(outputs[0])
                self._weights[key] = self._weights[id(_root(inputs[0]))]
                weakref.finalize(outputs[0], self._weights.pop, key, None)
        self.tally.ops.append(Op(kind, phase, self._block, dtype, flops, moved, name=name, **extra))
        return out

"""OFT (orthogonal finetuning) as ComfyUI loads it: each adapted layer's output features, in blocks of
``lora.rank`` (LyCORIS reads its ``dim`` as OFT's block size too), rotated by an orthogonal matrix
per block, ``W' = R_bᵀ · W_b`` for each block ``b`` of rows, the bias untouched.

peft's OFT (its parametrisation, exact Cayley transform, state dict, saving, enabling) with one
change: peft rotates a layer's *input* (``W' = W · R``, over input columns), ComfyUI's loader
(``comfy/weight_adapter/oft.py``, LyCORIS' diagonal OFT) rotates the weight's *rows*. An input-side
rotation has no exact row-side form, so the layers here apply peft's rotation module to the base
layer's output instead (``convert``), which is exactly what ComfyUI rebuilds from ``oft_blocks``.

The parametrisation: peft keeps, per block, the upper triangle ``v`` of a skew matrix
``Q = M(v) − M(v)ᵀ`` and rotates by ``R = (I − Q)(I + Q)⁻¹`` (exact, ``use_cayley_neumann=False``:
the Neumann series would not be orthogonal, nor ComfyUI's). ComfyUI builds
``R' = (I + Q')(I − Q')⁻¹`` from ``Q' = B − Bᵀ`` of the file's ``oft_blocks`` ``B``; with
``B = −M(v)``, ``R' = R``. No ``alpha`` is written: ComfyUI reads OFT's alpha as a norm
constraint (COFT), which is not trained here.

Strength: ComfyUI patches ``W + s²(R'ᵀ − I)W`` at LoRA strength ``s`` (it scales the difference by
``s`` twice), so the evaluation's strengths do the same; at 1 (and 0) it is the trained model.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..errors import ConfigError, ImgloraError
from .kind import Kind, Module, fail, need

if TYPE_CHECKING:
    from ..config import LoraConfig

ROTATION = "oft_R"  # peft's rotation module (its parameter: oft_R.<adapter>.weight)


class OutputRotation:
    """Mixin for peft's OFT Linear / Conv2d: the rotation applied to the base layer's output."""

    oft_strength: float = 1.0

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        previous = x.dtype
        if self.disable_adapters or self.merged:
            if self.disable_adapters and self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        y = self.base_layer(x, *args, **kwargs)
        bias = getattr(self.get_base_layer(), "bias", None)
        channels = 1 if y.dim() == 4 else -1  # Conv2d: rotate the channels
        z = y if bias is None else y - _along(bias, y, channels)
        for name in self.active_adapters:
            if name in self.oft_R:
                z = rotate(self.oft_R[name], z, channels, self.oft_strength)
        return (z if bias is None else z + _along(bias, z, channels)).to(previous)

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        raise NotImplementedError("imglora's OFT rotates outputs; use merged_weight")

    def merge(self, safe_merge: bool = False, adapter_names: Any = None) -> None:
        """Fold the rotation into the base weight (peft's merge, on the output side)."""
        layer = self.get_base_layer()
        for name in adapter_names or self.active_adapters:
            if name in self.oft_R:
                merged = merged_weight(self.oft_R[name], layer.weight.data)
                if safe_merge and not torch.isfinite(merged).all():
                    raise ValueError(f"NaNs in the merged weights of adapter {name}")
                layer.weight.data.copy_(merged.to(layer.weight.dtype))
                self.merged_adapters.append(name)

    def unmerge(self) -> None:
        layer = self.get_base_layer()
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            r = rotation_matrices(self.oft_R[name]).float()  # orthogonal: R undoes Rᵀ
            w = layer.weight.data
            blocks = w.float().unflatten(0, (r.shape[0], r.shape[1]))
            layer.weight.data.copy_(torch.einsum("kcn,kn...->kc...", r, blocks).flatten(0, 1).to(w.dtype))


def _along(bias: torch.Tensor, y: torch.Tensor, channels: int) -> torch.Tensor:
    return bias.view(-1, 1, 1).to(y.dtype) if channels == 1 else bias.to(y.dtype)


def rotate(module: nn.Module, z: torch.Tensor, channels: int, strength: float = 1.0) -> torch.Tensor:
    """``z`` with each block of its ``channels`` dimension rotated by peft's rotation module (which
    rotates the last dimension of a 2-D input); ``strength`` s: ``z + s²(Rz − z)``, as ComfyUI."""
    moved = z.movedim(channels, -1) if channels != -1 else z
    flat = moved.reshape(-1, moved.shape[-1])
    out = module(flat.to(module.weight.dtype)).to(z.dtype)
    if strength != 1.0:
        out = flat + strength * strength * (out - flat)
    out = out.reshape(moved.shape)
    return out.movedim(-1, channels) if channels != -1 else out


def rotation_matrices(module: nn.Module) -> torch.Tensor:
    """[blocks, b, b]: peft's R per block (``_cayley_batch``; block sharing repeated)."""
    r = module._cayley_batch(module.weight, module.block_size, module.use_cayley_neumann,
                             module.num_cayley_neumann_terms)
    return r.repeat(module.in_features // module.block_size, 1, 1) if module.block_share else r


def merged_weight(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """The layer's weight with the rotation folded in: each block of rows ``W_b`` becomes ``R_bᵀ W_b``
    (what the output rotation computes), in fp32."""
    r = rotation_matrices(module).float()
    blocks = weight.float().unflatten(0, (r.shape[0], r.shape[1]))
    return torch.einsum("knc,kn...->kc...", r, blocks).flatten(0, 1)


def convert(model: nn.Module, config: Any) -> list[str]:
    """Make every peft OFT layer of ``model`` rotate its output: a rotation module over its output
    features (blocks of ``config.oft_block_size``, zero-initialised: the identity) replaces peft's
    over its inputs. Returns the converted modules' names."""
    from peft.tuners.oft import layer as peft_oft

    classes = dict(zip((peft_oft.Linear, peft_oft.Conv2d), output_classes()))
    done = []
    for name, m in model.named_modules():
        cls = classes.get(type(m))
        if cls is None:
            continue
        out, block = m.out_features, config.oft_block_size
        for adapter in list(m.oft_R.keys()):
            old = m.oft_R[adapter]
            new = peft_oft.OFTRotationModule(out // block, block * (block - 1) // 2, block, out, coft=False,
                                             block_share=False, use_cayley_neumann=False)
            nn.init.zeros_(new.weight)
            m.oft_R[adapter] = new.to(device=old.weight.device, dtype=old.weight.dtype)
            m.r[adapter], m.oft_block_size[adapter] = out // block, block
        m.__class__ = cls
        done.append(name)
    return done


def block_problems(model: nn.Module, names: list[str], block: int) -> list[str]:
    """Adapted layers whose output features are not a multiple of the block size."""
    return [f"{n} ({model.get_submodule(n).weight.shape[0]} outputs)" for n in names
            if model.get_submodule(n).weight.shape[0] % block]


_CLASSES: list[type] = []


def output_classes() -> tuple[type, type]:
    """peft's OFT Linear and Conv2d with the output rotation (made once, on first use: they need peft)."""
    if not _CLASSES:
        from peft.tuners.oft import layer as peft_oft

        _CLASSES.extend([type("OutputLinear", (OutputRotation, peft_oft.Linear), {"__module__": __name__}),
                         type("OutputConv2d", (OutputRotation, peft_oft.Conv2d), {"__module__": __name__})])
    return _CLASSES[0], _CLASSES[1]


# -- ComfyUI's form ---------------------------------------------------------------------------------


def _upper(vec: torch.Tensor, block: int) -> torch.Tensor:
    """M(v): [blocks, b, b], ``vec`` [blocks, b(b−1)/2] in the upper triangle (peft's order), zeros elsewhere."""
    rows, cols = torch.triu_indices(block, block, 1)
    m = torch.zeros(vec.shape[0], block, block, dtype=vec.dtype)
    m[:, rows, cols] = vec.detach().cpu()
    return m


def comfy_blocks(vec: torch.Tensor) -> torch.Tensor:
    """ComfyUI's ``oft_blocks`` [blocks, b, b] from peft's ``oft_R.weight`` [blocks, b(b−1)/2]: ``−M(v)``
    (see the module docstring), in ``vec``'s dtype."""
    return (-_upper(vec, block_size(vec))).contiguous()


def block_size(vec: torch.Tensor) -> int:
    """b from the number of upper-triangle entries n = b(b−1)/2."""
    n = vec.shape[-1]
    b = int(round((1 + (1 + 8 * n) ** 0.5) / 2))
    if vec.dim() != 2 or b * (b - 1) // 2 != n:
        raise ValueError(f"an OFT rotation's parameters are [blocks, b(b-1)/2]; got {tuple(vec.shape)}")
    return b


def delta(vec: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The merged weight minus the base weight for rotation parameters ``vec`` [blocks, n], in fp32
    (exact Cayley ``R = (I − Q)(I + Q)⁻¹``, ``Q = M − Mᵀ``; each block of rows becomes ``Rᵀ W_b``)."""
    b = block_size(vec)
    m = _upper(vec.float(), b)
    q = m - m.transpose(1, 2)
    eye = torch.eye(b).expand_as(q)
    r = torch.linalg.solve(eye + q, eye - q, left=False)
    blocks = weight.float().unflatten(0, (r.shape[0], b))
    return torch.einsum("knc,kn...->kc...", r, blocks).flatten(0, 1) - weight.float()


# -- the kind ----------------------------------------------------------------------------------------


class Oft(Kind):
    name, label, peft_type, prefix = "oft", "OFT", "OFT", "oft_"
    suffixes = ("oft_R.weight",)  # peft's rotation, applied to the layer's output
    needs_base_weight = False     # its delta needs the weight; its ComfyUI form does not

    def peft_config(self, s: "LoraConfig", targets: str | list[str]) -> Any:
        from peft import OFTConfig

        return OFTConfig(r=0, oft_block_size=s.rank, target_modules=targets, init_weights=True, coft=False,
                         block_share=False, use_cayley_neumann=False)

    def before_inject(self, model: nn.Module, config: Any, s: "LoraConfig") -> None:
        from peft.tuners.tuners_utils import check_target_module_exists

        adapted = [name for name, m in model.named_modules()
                   if check_target_module_exists(config, name) and getattr(m, "weight", None) is not None]
        bad = block_problems(model, adapted, s.rank)
        if bad:
            raise ConfigError([f"lora.rank = {s.rank}: OFT's block size must divide every adapted layer's output "
                               f"features, and {len(bad)} do not: {', '.join(bad[:3])}; choose a divisor (e.g. 32 "
                               "or 64 for widths that are multiples of them)"])

    def after_inject(self, model: nn.Module, config: Any) -> None:
        convert(model, config)

    def set_strength(self, layer: nn.Module, strength: float) -> None:
        if isinstance(layer, OutputRotation):
            layer.oft_strength = strength  # as ComfyUI: W + s²(R − I)W

    def refused(self, lo: "LoraConfig") -> tuple[dict[str, Any], str]:
        out: dict[str, Any] = {}
        if lo.alpha and lo.alpha != lo.rank:
            out["alpha"] = float(lo.rank)
        unset = {"block_ranks": {}, "block_alphas": {}, "conv_rank": 0, "conv_alpha": 0.0, "text_encoder": False}
        out |= {k: v for k, v in unset.items() if getattr(lo, k)}
        return out, ("has no meaning for lora.type = \"oft\" (an orthogonal rotation per block of lora.rank "
                     "outputs, unscaled)")

    def problems(self, lo: "LoraConfig", where: Any) -> list[str]:
        if lo.rank < 2:
            return [f"{where('lora.rank')}: OFT's block size must be at least 2, got {lo.rank}"]
        return []

    def check(self, m: Module) -> None:
        need(m, "oft_R.weight")
        vec = m.tensors["oft_R.weight"]
        try:
            b = block_size(vec)
        except ValueError as exc:
            fail(m, str(exc))
        if b != m.rank:
            fail(m, f"block size {m.rank} given, the rotation's blocks are {b} wide")
        if m.shape is not None and vec.shape[0] * b != m.shape[0]:
            fail(m, f"{vec.shape[0]} blocks of {b} rotate {vec.shape[0] * b} outputs, the base weight has {m.shape[0]}")

    def delta(self, m: Module, base_weight: Tensor | None) -> Tensor:
        """A rotation of the weight's rows: it depends on the weight."""
        if base_weight is None:
            raise ImgloraError(f"{m.name}: an OFT delta depends on the base weight; pass base_weight")
        return delta(m.tensors["oft_R.weight"], base_weight)

    def comfy_tensors(self, m: Module, base_weight: Tensor | None) -> dict[str, Tensor]:
        """ComfyUI's OFTAdapter: ``oft_blocks``, no alpha (it would be a norm constraint)."""
        if base_weight is not None and m.tensors["oft_R.weight"].shape[0] * m.rank != base_weight.shape[0]:
            fail(m, f"the rotation's blocks do not cover the base weight's {base_weight.shape[0]} outputs")
        return {"oft_blocks": comfy_blocks(m.tensors["oft_R.weight"])}

    def metadata(self, lo: "LoraConfig") -> dict[str, Any]:
        # LyCORIS' diagonal OFT (its dim: the block size), what ComfyUI's OFT loader reads
        return {"ss_network_module": "lycoris.kohya",
                "ss_network_args": json.dumps({"algo": "diag-oft", "block_size": str(lo.rank), "constraint": "0"})}

    def module_settings(self, meta: Any, module: str) -> tuple[float, int, bool]:
        return 0.0, int(meta["oft_block_size"]), False  # a rotation per block of outputs: no alpha, no patterns


OFT = Oft()

"""What an adapter type is to imglora: the ``Kind`` each ``adapters/<type>.py`` defines, and the
``Module`` (one adapted module's peft tensors) its methods work on.

A kind says, in one file: which peft config trains it (``peft_config``, with hooks before and
after peft injects it), which ``[lora]`` keys it reads and which it refuses (``keys``,
``refuses``, ``problems``), how peft's tensors are checked and how they merge (``check``,
``natural_shape``, ``delta``), the tensors ComfyUI's loader turns back into exactly peft's merged
weight (``comfy_tensors``), what kohya and LyCORIS write for it in the file's metadata
(``metadata``), and how a saved peft config names it (``peft_type``, ``module_settings``).
Nothing outside the kind's file branches on its name; the registry is ``imglora.adapters.KINDS``.

Family-unaware: a kind works on one module at a time; naming the module (``lora_unet_…``,
``transformer.…``) is the family's exporter's job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

import torch
from torch import Tensor, nn

from ..errors import ImgloraError

if TYPE_CHECKING:
    from ..config import LoraConfig

# ComfyUI's weight_decompose adds the eps of the weight's dtype; its normal patching is in fp32.
COMFY_EPS = torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class Module:
    """One adapted module: its peft tensors (by peft suffix) and the scale peft applies."""

    name: str                        # module path as in the state dict, e.g. "down_blocks.0.resnets.0.conv1"
    kind: str                        # the adapter type: a key of imglora.adapters.KINDS
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


class Kind:
    """An adapter type. Subclasses set the class attributes and implement the methods that raise."""

    name: ClassVar[str]                    # lora.type
    label: ClassVar[str]                   # as people write it: "LoRA", "LoHa"
    peft_type: ClassVar[str]               # peft's peft_type of its config
    suffixes: ClassVar[tuple[str, ...]]    # every suffix peft's state dict can hold per module
    prefix: ClassVar[str]                  # the prefix of its tensors' names ("lora_", "hada_")
    # [lora] keys that only some types read, each with its role: keys of one role are each other's
    # counterpart in another type (LoRA's dropout, LoHa's rank_dropout), named in the error.
    keys: ClassVar[Mapping[str, str | None]] = {}
    rslora: ClassVar[bool] = False         # peft's use_rslora applies
    needs_base_weight: ClassVar[bool] = False  # its ComfyUI form depends on the base weight

    # -- training ---------------------------------------------------------------------------------

    def peft_config(self, s: "LoraConfig", targets: str | list[str]) -> Any:
        raise NotImplementedError

    def before_inject(self, model: nn.Module, config: Any, s: "LoraConfig") -> None:
        """Checks that need the model (OFT: the block size divides every output)."""

    def after_inject(self, model: nn.Module, config: Any) -> None:
        """Changes to peft's layers once injected (OFT: rotate outputs, not inputs)."""

    def owns(self, layer: nn.Module) -> bool:
        """Whether a peft layer holds this type's tensors (its first suffix's module dict)."""
        return hasattr(layer, self.suffixes[0].split(".")[0])

    def set_strength(self, layer: nn.Module, strength: float) -> None:
        """Scale one of its adapted layers' update by ``strength`` (not 0; 0 disables the adapter)."""
        for name in list(getattr(layer, "scaling", {})):
            layer.set_scale(name, strength)

    def refused(self, lo: "LoraConfig") -> tuple[dict[str, Any], str]:
        """Keys other types read that are set and mean nothing here, each with the value that unsets
        it, and why (OFT: alpha, per-block ranks, conv ranks, text encoders)."""
        return {}, ""

    def problems(self, lo: "LoraConfig", where: Any) -> list[str]:
        """Config errors only this type has."""
        return []

    # -- its tensors ------------------------------------------------------------------------------

    def check(self, m: Module) -> None:
        """Completeness and shape consistency, including the given rank against the tensors (ImgloraError)."""
        self.check_tensors(m)
        if m.shape is not None:
            natural = self.natural_shape(m)
            if math.prod(natural) != math.prod(m.shape) or natural[0] != m.shape[0]:
                fail(m, f"the adapter's weight {tuple(natural)} does not fit the base weight {m.shape}")

    def check_tensors(self, m: Module) -> None:
        raise NotImplementedError

    def natural_shape(self, m: Module) -> tuple[int, ...]:
        """The shape of the adapter's weight before peft reshapes it to the base weight's shape."""
        raise NotImplementedError

    def unscaled(self, m: Module) -> Tensor:
        """The adapter's weight before peft's ``scaling`` and before reshaping (peft's get_delta_weight)."""
        raise NotImplementedError

    def delta(self, m: Module, base_weight: Tensor | None) -> Tensor:
        """peft's merged weight minus the base weight, shaped like it, in fp32 (fp64 in, fp64 out)."""
        return (self.unscaled(m) * m.scaling).reshape(target_shape(m, base_weight))

    def comfy_tensors(self, m: Module, base_weight: Tensor | None) -> dict[str, Tensor]:
        """``{suffix: tensor}`` that ComfyUI turns into exactly peft's merged weight for this module."""
        raise NotImplementedError

    # -- the file ---------------------------------------------------------------------------------

    def metadata(self, lo: "LoraConfig") -> dict[str, Any]:
        """What kohya and LyCORIS write for this type (``ss_network_module``, ``ss_network_args``)."""
        return {}

    def is_peft_config(self, meta: Mapping[str, Any]) -> bool:
        """Whether a saved peft config (adapter_config.json) is of this type."""
        return str(meta.get("peft_type", "LORA")).upper() == self.peft_type

    def module_settings(self, meta: Mapping[str, Any], module: str) -> tuple[float, int, bool]:
        """(alpha, rank, rsLoRA) of ``module`` as peft applies them, from its saved config and its
        rank and alpha patterns."""
        from peft.utils.other import get_pattern_key

        alpha = float(meta[self.alpha_key])
        rank = int(meta["r"])
        ranks, alphas = meta.get("rank_pattern") or {}, meta.get("alpha_pattern") or {}
        if ranks and (key := get_pattern_key(ranks.keys(), module)) in ranks:
            rank = int(ranks[key])
        if alphas and (key := get_pattern_key(alphas.keys(), module)) in alphas:
            alpha = float(alphas[key])
        return alpha, rank, bool(meta.get("use_rslora")) and self.rslora

    alpha_key: ClassVar[str] = "alpha"


# -- helpers the kinds share ---------------------------------------------------------------------


def need(m: Module, *suffixes: str) -> None:
    missing = [s for s in suffixes if s not in m.tensors]
    if missing:
        raise ImgloraError(f"{m.name}: {m.kind} adapter without {m.name}.{missing[0]}")


def fail(m: Module, what: str) -> None:
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in m.tensors.items())
    raise ImgloraError(f"{m.name}: {m.kind} tensors do not fit together ({what}): {shapes}")


def f32(t: Tensor) -> Tensor:
    """At least fp32 (the math of half-precision adapters is done in fp32)."""
    return t.detach() if t.dtype == torch.float64 else t.detach().float()


def target_shape(m: Module, base_weight: Tensor | None) -> tuple[int, ...]:
    from . import KINDS

    natural = KINDS[m.kind].natural_shape(m)
    if base_weight is not None:
        if math.prod(natural) != base_weight.numel() or natural[0] != base_weight.shape[0]:
            fail(m, f"the adapter's weight {tuple(natural)} does not fit the base weight {tuple(base_weight.shape)}")
        return tuple(base_weight.shape)
    return m.shape if m.shape is not None else natural


def cp(t: Tensor, wa: Tensor, wb: Tensor) -> Tensor:
    """peft's make_weight_cp (loha: "i j k l, j r, i p -> p r k l" with (t, wb, wa); lokr: "i j k l, i p, j r")."""
    return torch.einsum("i j k l, i p, j r -> p r k l", f32(t), f32(wa), f32(wb))


def alpha_tensor(value: float) -> Tensor:
    """A 0-dim float32, as kohya and LyCORIS write it; ComfyUI reads it with .item()."""
    return torch.tensor(float(value), dtype=torch.float32)


def copy(t: Tensor) -> Tensor:
    return t.detach().clone().contiguous()  # never share storage with the model (safetensors refuses shared tensors)


def row_norm(w: Tensor) -> Tensor:
    """Norm per output row, shaped (out, 1[, 1, 1]) (peft DoRA's get_weight_norm, ComfyUI's output axis)."""
    return w.reshape(w.shape[0], -1).norm(dim=1).reshape(w.shape[0], *[1] * (w.dim() - 1))


def lycoris_metadata(algo: str, lo: "LoraConfig", **extra: str) -> dict[str, Any]:
    """A ``lycoris.kohya`` network as LyCORIS records it (LoHa, LoKr)."""
    import json

    conv_rank, conv_alpha = conv_settings(lo)
    args = {"algo": algo, "conv_dim": str(conv_rank), "conv_alpha": f"{conv_alpha:g}",
            "use_tucker": str(lo.effective_conv2d), **extra}
    return {"ss_network_module": "lycoris.kohya", "ss_network_args": json.dumps(args)}


def lycoris_common(s: "LoraConfig", targets: str | list[str]) -> dict[str, Any]:
    """The settings peft's LoHa and LoKr configs share."""
    return dict(r=s.rank, alpha=s.alpha, rank_dropout=s.rank_dropout, module_dropout=s.module_dropout,
                use_effective_conv2d=s.effective_conv2d, target_modules=targets, init_weights=True)


def conv_settings(s: "LoraConfig") -> tuple[int, float]:
    """(rank, alpha) of the adapted Conv2d layers: lora.conv_rank / conv_alpha, where 0 means as
    lora.rank, and as lora.alpha when conv layers keep lora.rank (else conv_rank: scale 1)."""
    rank = s.conv_rank or s.rank
    return rank, s.conv_alpha or (float(s.conv_rank) if s.conv_rank else s.alpha)

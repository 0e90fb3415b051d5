"""LoRA adapters through peft: injection, the adapter state dict, and adapter strength."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .errors import ConfigError

if TYPE_CHECKING:
    from .config import LoraConfig as LoraSettings
    from .family import Family


def target_pattern(family: "Family", targets: list[str]) -> str | list[str]:
    """peft ``target_modules``: the family's scope (e.g. its block lists) limits the suffixes, so a
    suffix such as ``proj_out`` cannot also match a final projection of the same name."""
    names = list(targets) or list(family.lora_targets)
    if not family.lora_scope:
        return names
    alternatives = "|".join(re.escape(n) for n in names)
    return rf"{family.lora_scope}({alternatives})"


def peft_config(family: "Family", settings: "LoraSettings") -> Any:
    from peft import LoraConfig

    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=target_pattern(family, settings.targets), init_lora_weights=True)


def inject(model: nn.Module, family: "Family", settings: "LoraSettings", seed: int) -> Any:
    """Add a LoRA adapter to ``model`` (base weights frozen) and return its peft config.

    A is initialised from ``seed`` (B starts at zero, so the model's output is unchanged).
    """
    model.requires_grad_(False)
    config = peft_config(family, settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_adapter(config)
    n = sum(1 for name, _ in model.named_modules() if name.endswith(".lora_A.default"))
    if n == 0:
        raise ConfigError([f"lora.targets = {list(settings.targets) or list(family.lora_targets)} matched no "
                           f"module of the {family.name} model; check the names (see the family's defaults)"])
    return config


def keep_input_dtype(model: nn.Module) -> int:
    """Under autocast: let each LoRA layer take its input in the dtype it arrives in.

    peft casts a LoRA layer's input to the LoRA weights' dtype (fp32 here) before ``lora_A``; under
    autocast ``lora_A`` casts it straight back to bf16, so the result is the same bit for bit, but
    the cast copy is what autograd saves: every adapted layer keeps a second bf16 copy of its input
    for backward (and the fp32 one exists for a moment). Returns the layers changed. Only for
    autocast: without it, a bf16 input would meet fp32 weights."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    n = 0
    for m in model.modules():
        if isinstance(m, BaseTunerLayer):
            m.cast_input_dtype_enabled = False
            n += 1
    return n


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """LoRA weights keyed by module path (``<module>.lora_A.weight``), detached, on the CPU."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    from peft.utils import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, state)
    unexpected = getattr(result, "unexpected_keys", []) or []
    if unexpected:
        raise ValueError(f"adapter has keys the model lacks: {unexpected[:5]}")


def set_strength(model: nn.Module, strength: float) -> None:
    """Scale every LoRA layer's update by ``strength``; 0 disables the adapter, so each layer runs
    its base layer alone and the output is the base model's exactly."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    for m in model.modules():
        if isinstance(m, BaseTunerLayer):
            m.enable_adapters(strength != 0)
        if isinstance(m, LoraLayer) and strength != 0:
            for name in list(m.scaling):
                m.set_scale(name, strength)

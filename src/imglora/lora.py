"""LoRA adapters through peft: injection, the adapter state dict, and saving it where diffusers finds it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .config import LoraConfig as LoraSettings
    from .families import Family

ADAPTER_FILE = "pytorch_lora_weights.safetensors"  # the name diffusers' load_lora_weights looks for


def target_pattern(family: "Family", targets: list[str]) -> str | list[str]:
    """peft ``target_modules``: the family's scope (e.g. FLUX's block lists) limits the suffixes.

    Without a scope a suffix such as ``proj_out`` would also match FLUX's final projection.
    """
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
        from .errors import ConfigError

        raise ConfigError([f"lora.targets = {list(settings.targets) or list(family.lora_targets)} matched no "
                           f"module of the {family.name} model; check the names (see the family's defaults)"])
    return config


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


def save_for_diffusers(family: "Family", model: nn.Module, config: Any, folder: Path) -> Path:
    """Write ``folder/pytorch_lora_weights.safetensors`` as ``<Pipeline>.load_lora_weights`` reads it.

    Keys are ``<unet|transformer>.<module>.lora_A.weight``; the LoRA config (rank and alpha) goes
    into the header so diffusers applies alpha / rank exactly, also when alpha differs from rank.
    """
    import diffusers

    meta = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.to_dict().items()}
    pipeline = getattr(diffusers, family.pipeline)
    pipeline.save_lora_weights(folder, **{f"{family.denoiser}_lora_layers": adapter_state_dict(model),
                                          f"{family.denoiser}_lora_adapter_metadata": meta})
    return folder / ADAPTER_FILE


def read_diffusers_adapter(family: "Family", folder: Path) -> dict[str, torch.Tensor]:
    """The LoRA state (keys without the ``unet.``/``transformer.`` prefix) of a saved adapter."""
    from safetensors.torch import load_file

    prefix = f"{family.denoiser}."
    weights = load_file(str(Path(folder) / ADAPTER_FILE))
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}

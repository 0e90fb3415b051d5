"""Adapters through peft (LoRA, DoRA, LoHa, LoKr, OFT): injection, the adapter state dict, and strength.

peft rather than the LyCORIS package: peft is already how the trainer injects, saves, resumes and
scales LoRA, and it has all four types behind the same calls (``add_adapter``, its state dict,
``set_scale``), so each type trains, checkpoints and resumes through the code LoRA uses.
ComfyUI's loader needs a few conversions of peft's tensors (each type's file: LoKr's alpha
folded when both factors are full, LoKr's CP form written flat, DoRA's magnitude compensated for
ComfyUI's normalisation, OFT's rotation moved to the output side), far less code than a second
injection library with its own saving, fp8 and block-swap interplay. Nothing here names a type:
each type's peft config and its hooks are in ``adapters/<type>.py`` (``KINDS``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import KINDS, blocks as lora_blocks
from .forms import ADAPTER_PREFIXES
from .kind import conv_settings
from ..errors import ConfigError
from ..family import option

if TYPE_CHECKING:
    from ..config import LoraConfig as LoraSettings
    from ..family import Family


def target_pattern(family: "Family", targets: list[str]) -> str | list[str]:
    """peft ``target_modules``: the family's scope (e.g. its block lists) limits the suffixes, so a
    suffix such as ``proj_out`` cannot also match a final projection of the same name."""
    names = list(targets) or list(family.lora_targets)
    if not family.lora_scope:
        return names
    alternatives = "|".join(re.escape(n) for n in names)
    return rf"{family.lora_scope}({alternatives})"


def is_adapter_parameter(name: str) -> bool:
    """Whether a parameter name (``...to_q.lora_A.default.weight``, ``...hada_w1_a.default``) is an adapter's."""
    return any(part.startswith(ADAPTER_PREFIXES) for part in name.split("."))


def peft_config(family: "Family", settings: "LoraSettings", model: nn.Module | None = None,
                targets: str | list[str] | None = None) -> Any:
    """The peft config of ``lora.type``: LoraConfig (``use_dora`` for DoRA), LoHaConfig, LoKrConfig or
    OFTConfig (blocks of ``lora.rank``, exact Cayley; turned to the output side by ``oft.convert``).

    With ``model``, the adapted Conv2d layers get ``lora.conv_rank`` / ``lora.conv_alpha`` through
    peft's ``rank_pattern`` / ``alpha_pattern`` (one exact, escaped module name each). ``targets``:
    peft target_modules other than the family's (e.g. a text encoder's).
    """
    s = settings
    targets = target_pattern(family, s.targets) if targets is None else targets
    config = KINDS[s.type].peft_config(s, targets)
    if model is not None and option(family, "unused_outputs") is not None:
        # Layers whose output the model throws away (Qwen-Image's last block's text stream) would
        # get no gradient: an adapter there only costs memory and exports zero deltas.
        config.exclude_modules = family.unused_outputs(model) or None
    conv_rank, conv_alpha = conv_settings(s)
    blockwise = bool(s.blocks or s.block_ranks or s.block_alphas)
    if model is not None and ((conv_rank, conv_alpha) != (s.rank, s.alpha) or blockwise):
        from peft.tuners.tuners_utils import check_target_module_exists

        adapted = [name for name, m in model.named_modules() if check_target_module_exists(config, name)]
        if s.blocks:  # only the selected blocks' modules, named exactly (a regex peft matches in full)
            adapted = lora_blocks.selected(model, family, adapted, list(s.blocks))
            if not adapted:
                raise ConfigError([f"lora.blocks = {list(s.blocks)}: no adapted module is in these blocks"])
            config.target_modules = "(" + "|".join(re.escape(n) for n in adapted) + ")"
        convs = [n for n in adapted if isinstance(model.get_submodule(n), nn.Conv2d)]
        ranks = {n: conv_rank for n in convs} if conv_rank != s.rank else {}
        alphas = {n: conv_alpha for n in convs} if conv_alpha != s.alpha else {}
        # Per block (kohya's block_dims / block_alphas): a block's rank, and its alpha as given, else
        # lora.alpha (as kohya's block_alphas default to network_alpha).
        ranks |= {n: int(r) for n, r in lora_blocks.per_module(model, family, adapted, dict(s.block_ranks)).items()}
        alphas |= {n: float(a) for n, a in lora_blocks.per_module(model, family, adapted, dict(s.block_alphas)).items()}
        config.rank_pattern = {re.escape(n): r for n, r in ranks.items() if r != s.rank}
        config.alpha_pattern = {re.escape(n): a for n, a in alphas.items() if a != s.alpha}
    return config


def inject(model: nn.Module, family: "Family", settings: "LoraSettings", seed: int,
           targets: str | list[str] | None = None) -> Any:
    """Add an adapter of ``lora.type`` to ``model`` (base weights frozen) and return its peft config.

    Initialised from ``seed``; the update starts at zero (LoRA/DoRA: B = 0; LoHa: one pair's up
    factor 0; LoKr: the second factor 0), so the model's output is unchanged.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    model.requires_grad_(False)
    config = peft_config(family, settings, model, targets)
    KINDS[settings.type].before_inject(model, config, settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_adapter(config)
    if not any(isinstance(m, BaseTunerLayer) for m in model.modules()):
        raise ConfigError([f"lora.targets = {list(settings.targets) or list(family.lora_targets)} matched no "
                           f"module of the {family.name} model; check the names (see the family's defaults)"])
    KINDS[settings.type].after_inject(model, config)
    return config


def inject_text_encoders(encoders: dict[str, nn.Module], family: Any, settings: "LoraSettings",
                         seed: int) -> dict[str, Any]:
    """lora.text_encoder: the same adapter type on each text encoder's attention and MLP projections
    (the family's ``text_encoder_targets`` within ``text_encoder_scope``), each initialised from its
    own seed; returns their peft configs by component."""
    from peft import inject_adapter_in_model

    alternatives = "|".join(re.escape(n) for n in family.text_encoder_targets)
    configs = {}
    for i, (part, encoder) in enumerate(encoders.items(), 1):
        encoder.requires_grad_(False)
        config = peft_config(family, settings, encoder, rf".*{family.text_encoder_scope}({alternatives})")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + i)
            inject_adapter_in_model(config, encoder)  # transformers' add_adapter wants peft's LoRA only
        configs[part] = config
    return configs


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


def parameter_groups(model: nn.Module, lr: float, loraplus_lr_ratio: float = 0.0,
                     multipliers: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """The adapter's optimizer groups at ``lr``; with LoRA+ (Hayou et al. 2024, kohya's
    ``loraplus_lr_ratio``) the B matrices (kohya's lora_up) in a group of their own at ``lr`` times the
    ratio, everything else (A, DoRA's magnitudes) at ``lr``; ``multipliers`` ({module path:
    factor}, lora.block_lr) scale the learning rate of each module's parameters (LoRA+ on top)."""
    multipliers = multipliers or {}
    if not loraplus_lr_ratio and not multipliers:
        return [{"params": trainable_parameters(model), "lr": lr}]
    groups: dict[tuple[float, bool], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            module = _adapted_module(name)
            up = bool(loraplus_lr_ratio) and ".lora_B." in name
            groups.setdefault((multipliers.get(module, 1.0), up), []).append(p)
    return [{"params": params, "lr": lr * factor * (loraplus_lr_ratio if up else 1.0)}
            for (factor, up), params in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0]))]


def _adapted_module(parameter: str) -> str:
    """``a.b.to_q.lora_A.default.weight`` -> ``a.b.to_q`` (the adapted module's path)."""
    parts = parameter.split(".")
    for i, part in enumerate(parts):
        if part.startswith(ADAPTER_PREFIXES):
            return ".".join(parts[:i])
    return parameter


def block_multipliers(model: nn.Module, family: Any, settings: "LoraSettings") -> dict[str, float]:
    """lora.block_lr as {adapted module path: multiplier}."""
    if not settings.block_lr:
        return {}
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapted = [n for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]
    return lora_blocks.per_module(model, family, adapted, dict(settings.block_lr))


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter weights keyed by module path (``<module>.lora_A.weight``, ``<module>.hada_w1_a``, ...),
    detached, on the CPU."""
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
    from peft.tuners.tuners_utils import BaseTunerLayer

    for m in model.modules():
        if isinstance(m, BaseTunerLayer):
            m.enable_adapters(strength != 0)
            if strength != 0:
                kind = next((k for k in KINDS.values() if k.owns(m)), None)
                if kind is not None:
                    kind.set_strength(m, strength)

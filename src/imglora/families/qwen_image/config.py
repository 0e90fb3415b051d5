"""The ``[qwen_image]`` preset section: the flow-matching objective's keys (how timesteps are drawn,
how the loss is weighted over them) with Qwen-Image's defaults. Block swapping needs no key of its
own: Qwen-Image has one list of 60 blocks, and ``memory.blocks_to_swap`` counts them directly (as
musubi-tuner and ai-toolkit count them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...config import setting
from .._shared.flow_matching import FlowMatchingObjective


@dataclass(frozen=True)
class QwenImageConfig(FlowMatchingObjective):
    # The model's own sampling shift (its scheduler's dynamic shift: e^mu with mu linear in the image's
    # token count, about 2.0 at 1024²), as musubi-tuner's "qwen_shift" and diffusers' training script.
    timestep_sampling: Literal["sigmoid", "logit_normal", "uniform", "shift"] = setting(
        "shift", help="How training timesteps are drawn (shift: a shifted sigmoid of a normal draw; with "
                      "resolution_dependent_shift the shift Qwen-Image samples with at that size).")
    resolution_dependent_shift: bool = setting(
        True, help="Derive the shift from the image size as Qwen-Image's scheduler does (its dynamic shift); "
                   "false: discrete_flow_shift.")
    discrete_flow_shift: float = setting(2.2, help="Shift for timestep_sampling = \"shift\" without "
                                                   "resolution_dependent_shift (musubi-tuner's 2.2).",
                                         min=0.0, max=100.0, min_exclusive=True)

"""The ``[flux2]`` preset section: the flow-matching objective's keys with FLUX.2's defaults.

Training timesteps are drawn as musubi-tuner's recommended ``flux2_shift`` draws them (and
OneTrainer's dynamic shift): a sigmoid of a normal draw, shifted by e^mu with mu linear in the
image's token count (0.5 at 256 tokens, 1.15 at 4096: about 3.2 at 1024²), FLUX.1's rule on FLUX.2's
tokens (one per 16×16 pixels). Block swapping needs no key of its own: ``memory.blocks_to_swap``
counts blocks, single ones first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...config import setting
from .._shared.flow_matching import FlowMatchingObjective


@dataclass(frozen=True)
class Flux2Config(FlowMatchingObjective):
    timestep_sampling: Literal["sigmoid", "logit_normal", "uniform", "shift"] = setting(
        "shift", help="How training timesteps are drawn (shift: a shifted sigmoid of a normal draw; with "
                      "resolution_dependent_shift the shift depends on the image's size).")
    resolution_dependent_shift: bool = setting(
        True, help="Derive the shift from the image's token count (musubi-tuner's flux2_shift); false: "
                   "discrete_flow_shift.")

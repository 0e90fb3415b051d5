"""The ``[krea2]`` preset section: the flow-matching objective's keys with Krea 2's defaults:
timesteps shifted as the pipeline samples them at the image's size (mu linear in the token count,
from the model's scheduler config: 0.5 at 256 tokens, 1.15 at 6400; about 2.5 at 1024²), as
musubi-tuner's ``krea2_shift``. ``memory.blocks_to_swap`` counts the 28 blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...config import setting
from .._shared.flow_matching import FlowMatchingObjective


@dataclass(frozen=True)
class Krea2Config(FlowMatchingObjective):
    timestep_sampling: Literal["sigmoid", "logit_normal", "uniform", "shift"] = setting(
        "shift", help="How training timesteps are drawn (shift: a shifted sigmoid of a normal draw).")
    resolution_dependent_shift: bool = setting(
        True, help="Derive the shift from the image size as Krea 2's scheduler does; false: discrete_flow_shift "
                   "(musubi-tuner's example: 2.5).")
    discrete_flow_shift: float = setting(2.5, help="Shift for timestep_sampling = \"shift\" without "
                                                   "resolution_dependent_shift.", min=0.0, max=100.0,
                                         min_exclusive=True)

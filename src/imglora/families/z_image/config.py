"""The ``[z_image]`` preset section: the flow-matching objective's keys with Z-Image's defaults.

Z-Image's schedulers use a fixed shift (Turbo 3.0, Base 6.0; no resolution-dependent shift), and
the diffusers training script draws training timesteps from that shifted schedule; musubi-tuner
suggests a shift of 2.0 for LoRAs. The default here is the Turbo scheduler's 3.0 with kohya's shifted
sigmoid draw. Block swapping needs no key of its own: ``memory.blocks_to_swap`` counts the 30 main
blocks directly (as musubi-tuner counts them; the four small refiner blocks are never swapped)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...config import setting
from .._shared.flow_matching import FlowMatchingObjective


@dataclass(frozen=True)
class ZImageConfig(FlowMatchingObjective):
    timestep_sampling: Literal["sigmoid", "logit_normal", "uniform", "shift"] = setting(
        "shift", help="How training timesteps are drawn (shift: a shifted sigmoid of a normal draw, "
                      "discrete_flow_shift).")
    discrete_flow_shift: float = setting(3.0, help="Shift for timestep_sampling = \"shift\": 3.0 is Z-Image "
                                                   "Turbo's scheduler shift (Base's is 6.0; musubi-tuner suggests 2.0).",
                                         min=0.0, max=100.0, min_exclusive=True)
    resolution_dependent_shift: bool = setting(
        False, help="Z-Image's schedulers have no resolution-dependent shift; true uses FLUX.1-dev's.")

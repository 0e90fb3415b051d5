"""The ``[chroma]`` preset section: FLUX.1's flow-matching keys (timesteps, weighting, swap split),
with the defaults the peers use for Chroma, and no guidance embedding (Chroma has none)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...config import setting
from ..flux.config import FlowMatchingConfig


@dataclass(frozen=True)
class ChromaConfig(FlowMatchingConfig):
    # ai-toolkit's default for Chroma, and kohya's recommendation: sigmoid of a standard normal, no shift.
    timestep_sampling: Literal["sigmoid", "logit_normal", "uniform", "shift"] = setting(
        "sigmoid", help="How training timesteps are drawn (sigmoid: as ai-toolkit and kohya train Chroma).")

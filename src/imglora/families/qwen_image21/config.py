"""The ``[qwen_image21]`` preset section: the flow-matching objective's keys with Qwen-Image 2.1's
defaults. No trainer published settings for 2.1 yet; imglora draws training timesteps as the
pipeline samples them at the image's size: a sigmoid of a normal draw shifted by e^mu, mu linear in
the token count (from the model's scheduler config: 0.5 at 256 tokens, 0.9 at 8192; about 0.69, a
shift of 2.0, at 1024²), the rule musubi-tuner and ai-toolkit apply to Qwen-Image.
``memory.blocks_to_swap`` counts the 32 blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...config import setting
from .._shared.flow_matching import FlowMatchingObjective


@dataclass(frozen=True)
class QwenImage21Config(FlowMatchingObjective):
    timestep_sampling: Literal["sigmoid", "logit_normal", "uniform", "shift"] = setting(
        "shift", help="How training timesteps are drawn (shift: a shifted sigmoid of a normal draw).")
    resolution_dependent_shift: bool = setting(
        True, help="Derive the shift from the image size as Qwen-Image 2.1's scheduler does; false: "
                   "discrete_flow_shift.")
    discrete_flow_shift: float = setting(2.0, help="Shift for timestep_sampling = \"shift\" without "
                                                   "resolution_dependent_shift.", min=0.0, max=100.0,
                                         min_exclusive=True)

"""The ``[flux]`` preset section: settings only the FLUX family (and those on its architecture) reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...config import setting


@dataclass(frozen=True)
class FlowMatchingObjective:
    """The keys of a flow-matching objective on packed latents: how timesteps are drawn and how the
    loss is weighted over them (FLUX.1's, and the families trained the same way)."""

    timestep_sampling: Literal["sigmoid", "logit_normal", "uniform", "shift"] = setting(
        "shift", help="How training timesteps are drawn.", moved_from="train.timestep_sampling")
    sigmoid_scale: float = setting(1.0, help="Scale of the normal draw for sigmoid/shift sampling.", min=0.0,
                                   max=100.0, min_exclusive=True, moved_from="train.sigmoid_scale")
    discrete_flow_shift: float = setting(3.1582, help="Shift for timestep_sampling = \"shift\".", min=0.0,
                                         max=100.0, min_exclusive=True, moved_from="train.discrete_flow_shift")
    resolution_dependent_shift: bool = setting(False, help="Derive the shift from the image size as FLUX.1-dev "
                                                           "inference does.",
                                               moved_from="train.resolution_dependent_shift")
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = setting(
        "none", help="Weighting of the flow-matching loss over noise levels (as SD3 / kohya).",
        moved_from="train.loss_weighting")


@dataclass(frozen=True)
class FlowMatchingConfig(FlowMatchingObjective):
    """FLUX.1's architecture: the objective's keys and the split of swapped blocks between its double
    and single blocks (FLUX.1's, and the families on its architecture)."""

    double_blocks_to_swap: int = setting(-1, help="Double blocks to swap, set directly; -1 = from "
                                                  "memory.blocks_to_swap (kohya's count).", min=-1, max=1000,
                                         resume_safe=True, moved_from="memory.double_blocks_to_swap")
    single_blocks_to_swap: int = setting(-1, help="Single blocks to swap, set directly; -1 = from "
                                                  "memory.blocks_to_swap (kohya's count).", min=-1, max=1000,
                                         resume_safe=True, moved_from="memory.single_blocks_to_swap")


@dataclass(frozen=True)
class FluxConfig(FlowMatchingConfig):
    guidance: float = setting(1.0, help="Guidance embedding value during training (1.0 for FLUX.1-dev).", min=0.0,
                              max=100.0, moved_from="train.guidance")
    apply_t5_attn_mask: bool = setting(
        False, help="T5's attention mask (kohya's apply_t5_attn_mask): T5 reads the caption without its padding, and "
                    "the transformer's attention ignores the padding tokens, in training and in the evaluation pass. The "
                    "cached text entries are keyed by it. Off by default: FluxPipeline and ComfyUI encode and sample "
                    "without it.")

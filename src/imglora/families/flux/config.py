"""The ``[flux]`` preset section: settings only the FLUX family (and those on its architecture) reads."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import setting
from .._shared.flow_matching import FlowMatchingObjective


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

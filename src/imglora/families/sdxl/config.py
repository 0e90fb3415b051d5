"""The ``[sdxl]`` preset section: settings only the SDXL family reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...config import setting


@dataclass(frozen=True)
class SdxlConfig:
    noise_offset: float = setting(0.0, help="Noise offset strength (a per-channel constant shift of the noise, so "
                                            "the model learns to change overall brightness).", min=0.0, max=1.0,
                                  moved_from="train.noise_offset")
    min_snr_gamma: float = setting(0.0, help="Min-SNR-γ loss weighting; 0 = off (5 is common).", min=0.0,
                                   max=1000.0, moved_from="train.min_snr_gamma")
    prediction_type: Literal["auto", "epsilon", "v_prediction"] = setting(
        "auto", help="What the UNet predicts; auto = what the model says (its scheduler config, or a single file's "
                     "v_pred key / modelspec metadata). Set it for a v-prediction finetune that does not say so.")

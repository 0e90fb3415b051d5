"""The ``[flux_kontext]`` preset section: the ``[flux]`` keys, for the same transformer and objective."""

from __future__ import annotations

from dataclasses import dataclass

from ..flux.config import FluxConfig


@dataclass(frozen=True)
class FluxKontextConfig(FluxConfig):
    """FLUX.1 Kontext [dev] is FLUX.1-dev's transformer trained further on edit pairs: timestep
    sampling, loss weighting, guidance and the swap split are read as for FLUX.1."""

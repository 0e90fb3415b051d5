"""Fixtures: the tiny models, and every single-file layout written from them once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from layouts import write_bfl_flux, write_clip_l, write_flux_ae, write_sdxl_vae, write_sgm_sdxl, write_t5xxl

from imglora.families import registry
from imglora.models.tiny import ensure_tiny


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every module here runs on one thread (tests/conftest.py's one_thread)."""


@pytest.fixture(scope="session")
def sdxl_dir() -> Path:
    return ensure_tiny(registry.get("sdxl"))


@pytest.fixture(scope="session")
def flux_dir() -> Path:
    return ensure_tiny(registry.get("flux"))


@pytest.fixture(scope="session")
def files(tmp_path_factory, sdxl_dir: Path, flux_dir: Path) -> dict[str, Path]:
    """name -> file, in the layouts users download (float32 weights unless the format fixes them)."""
    d = tmp_path_factory.mktemp("singlefile")
    return {
        "sgm": write_sgm_sdxl(sdxl_dir, d / "sd_xl_base_1.0.safetensors"),
        "sgm_novae": write_sgm_sdxl(sdxl_dir, d / "sdxl_novae.safetensors", vae=False),
        "sgm_vpred": write_sgm_sdxl(sdxl_dir, d / "sdxl_vpred.safetensors", v_pred=True),
        "sdxl_vae": write_sdxl_vae(sdxl_dir, d / "sdxl_vae.safetensors"),
        "bfl": write_bfl_flux(flux_dir, d / "flux1-dev.safetensors"),
        "bfl_prefixed": write_bfl_flux(flux_dir, d / "flux1-dev-ckpt.safetensors", prefix="model.diffusion_model."),
        "bfl_fp8": write_bfl_flux(flux_dir, d / "flux1-dev-fp8.safetensors", fp8=True),
        "bfl_scaled": write_bfl_flux(flux_dir, d / "flux1-dev-fp8-scaled.safetensors", scaled=True),
        "clip_l": write_clip_l(flux_dir, d / "clip_l.safetensors"),
        "t5": write_t5xxl(flux_dir, d / "t5xxl_fp16.safetensors"),
        "t5_fp8": write_t5xxl(flux_dir, d / "t5xxl_fp8_e4m3fn.safetensors", fp8=True),
        "ae": write_flux_ae(flux_dir, d / "ae.safetensors"),
    }


"""A model given as single files keys its cache entries by those files' contents: another VAE file
gives other latent keys (``--verify`` says the old entries are stale, the next fill re-encodes), another
text encoder file other text keys; the other kind's entries are kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from layouts import write_bfl_flux, write_clip_l, write_flux_ae, write_t5xxl
from safetensors.torch import load_file, save_file

from imglora.cli import main
from imglora.commands.common import load_config
from imglora.data import cache
from imglora.families import registry
from imglora.models.resolve import resolve_model
from imglora.models.tiny import ensure_tiny

REPO = Path(__file__).resolve().parents[3]
PRESET = REPO / "presets" / "tiny-flux.toml"


def _nudged(src: Path, dest: Path) -> Path:
    """The same file with one weight changed a little: another model of the same shape."""
    sd = load_file(str(src))
    name = sorted(k for k, v in sd.items() if v.is_floating_point() and v.ndim >= 2)[0]
    sd[name] = sd[name] + 0.01
    save_file(sd, str(dest))
    return dest


@pytest.fixture(scope="module")
def flux_files(tmp_path_factory) -> dict[str, Path]:
    tiny = ensure_tiny(registry.get("flux"))
    d = tmp_path_factory.mktemp("flux-key-files")
    f = {"transformer": write_bfl_flux(tiny, d / "flux1-dev.safetensors"),
         "clip_l": write_clip_l(tiny, d / "clip_l.safetensors"),
         "t5": write_t5xxl(tiny, d / "t5xxl_fp16.safetensors"),
         "ae": write_flux_ae(tiny, d / "ae.safetensors")}
    f["ae_other"] = _nudged(f["ae"], d / "ae_finetuned.safetensors")
    f["clip_l_other"] = _nudged(f["clip_l"], d / "clip_l_finetuned.safetensors")
    return f


@pytest.fixture()
def setup(small_run, flux_files):
    overrides = small_run(("01_sky", "02_grass"))

    def files(vae: str = "ae", clip: str = "clip_l") -> list[str]:
        f = flux_files
        return [*overrides, f"model.path={json.dumps(str(f['transformer']))}",
                f"model.text_encoder={json.dumps(str(f[clip]))}", f"model.text_encoder_2={json.dumps(str(f['t5']))}",
                f"model.vae={json.dumps(str(f[vae]))}",
                f"model.config={json.dumps(str(ensure_tiny(registry.get('flux'))))}"]

    def load(**kw: str):
        cfg = load_config(PRESET, files(**kw))
        family = registry.get("flux")
        return cfg, family, resolve_model(cfg.model, family)

    return files, load


def _keys(load, **kw: str) -> tuple[set[str], set[str]]:
    cfg, family, src = load(**kw)
    p = cache.plan(cfg, family, src, "cpu")
    return {s.key for s in p.latents}, {s.key for s in p.texts.values()}


def test_another_vae_file_is_another_latent_key_and_its_entries_are_stale(setup) -> None:
    files, load = setup
    lat, txt = _keys(load)
    lat_other, txt_other = _keys(load, vae="ae_other")
    assert lat.isdisjoint(lat_other) and txt == txt_other  # the VAE makes latents, not text entries
    _, first = cache.fill_cache(*load(), "cpu", progress=False)
    assert first.latents_encoded == 2
    args = ["cache-latents", str(PRESET), *[x for o in files(vae="ae_other") for x in ("--set", o)]]
    verify = CliRunner().invoke(main, [*args, "--verify"])
    assert verify.exit_code == 1, verify.output
    assert "2 entries ok, 2 missing, 2 stale, 0 corrupt" in verify.output
    assert "stale: latents of" in verify.output and "its source, model or settings changed" in verify.output
    _, second = cache.fill_cache(*load(vae="ae_other"), "cpu", progress=False)  # what training runs first
    assert (second.latents_encoded, second.latents_reused, second.texts_encoded) == (2, 0, 0)
    assert second.loaded_vae and not second.loaded_text_encoders


def test_another_text_encoder_file_is_another_text_key(setup) -> None:
    _, load = setup
    lat, txt = _keys(load)
    lat_other, txt_other = _keys(load, clip="clip_l_other")
    assert txt.isdisjoint(txt_other) and lat == lat_other
    cache.fill_cache(*load(), "cpu", progress=False)
    _, stats = cache.fill_cache(*load(clip="clip_l_other"), "cpu", progress=False)
    assert (stats.texts_encoded, stats.texts_reused, stats.latents_encoded) == (2, 0, 0)


def test_a_weight_file_in_the_key_is_hashed_once_and_remembered(setup, flux_files, monkeypatch) -> None:
    """Multi-GB single files are read once: the key's content hash is remembered per file."""
    _, load = setup
    _keys(load)
    from imglora.runs import record

    monkeypatch.setattr(record, "sha256_file", lambda p: pytest.fail(f"{p} hashed again"))
    _keys(load)

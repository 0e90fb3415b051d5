from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from imglora.commands.common import load_config
from imglora.runs import record
from imglora.cli import main
from imglora.data import cache
from imglora.families import get_family
from imglora.models.resolve import resolve_model

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-sdxl.toml"


@pytest.fixture()
def setup(tmp_path: Path, small_run):
    overrides = small_run()
    data = tmp_path / "data"

    def load(*extra: str):
        cfg = load_config(PRESET, [*overrides, *extra])
        family = get_family(cfg.model.family)
        return cfg, family, resolve_model(cfg.model.path, get_family(cfg.model.family))

    return data, overrides, load


def fill(load, *extra):
    cfg, family, model_dir = load(*extra)
    return cache.fill_cache(cfg, family, model_dir, "cpu", progress=False)


def test_second_run_encodes_nothing_and_loads_no_encoder(setup) -> None:
    _, _, load = setup
    plan, first = fill(load)
    assert (first.latents_encoded, first.texts_encoded) == (3, 3)
    assert first.loaded_vae and first.loaded_text_encoders
    _, second = fill(load)
    assert (second.latents_encoded, second.texts_encoded, second.latents_reused, second.texts_reused) == (0, 0, 3, 3)
    assert not second.loaded_vae and not second.loaded_text_encoders
    entry = cache.Cache(load()[0].cache.dir).get("latents", plan.latents[0].key)
    assert entry["latents"].shape == (4, 128 // 8, 128 // 8)  # square sample image, 128 px bucket
    w, h = Image.open(plan.latents[0].item.path).size
    assert w == h  # (h, w) original size, (top, left) crop, (h, w) target, as SDXL's add_time_ids
    assert entry["time_ids"].tolist() == [h, w, 0.0, 0.0, 128.0, 128.0]


def test_editing_one_caption_reencodes_exactly_that_text(setup) -> None:
    data, _, load = setup
    fill(load)
    (data / "02_grass.txt").write_text("sks toy, a striped ball on short green grass")
    _, stats = fill(load)
    assert (stats.texts_encoded, stats.texts_reused, stats.latents_encoded) == (1, 2, 0)
    assert not stats.loaded_vae


def test_editing_one_image_reencodes_exactly_that_latent(setup) -> None:
    data, _, load = setup
    fill(load)
    img = Image.open(data / "01_sky.png").convert("RGB")
    img.putpixel((5, 5), (0, 0, 0))
    img.save(data / "01_sky.png")
    _, stats = fill(load)
    assert (stats.latents_encoded, stats.latents_reused, stats.texts_encoded) == (1, 2, 0)


def test_changing_resolution_or_model_never_reuses_latents(setup, tmp_path: Path) -> None:
    _, _, load = setup
    fill(load)
    _, stats = fill(load, "data.resolution=192")
    assert stats.latents_reused == 0 and stats.latents_encoded == 3
    assert stats.texts_reused == 3  # captions and encoders did not change

    # Another VAE (same architecture, different weights) must not reuse latents either.
    model = tmp_path / "other-model"
    shutil.copytree(resolve_model("tiny:sdxl", get_family("sdxl")).root, model)
    cfg_path = model / "vae" / "config.json"
    vae_cfg = json.loads(cfg_path.read_text())
    vae_cfg["scaling_factor"] = 0.2
    cfg_path.write_text(json.dumps(vae_cfg))
    _, stats = fill(load, f"model.path={json.dumps(str(model))}")
    assert stats.latents_reused == 0 and stats.texts_reused == 3


def test_flip_caches_both_variants(setup) -> None:
    _, _, load = setup
    plan, stats = fill(load, "data.flip=true")
    assert stats.latents_encoded == 6
    cfg = load("data.flip=true")[0]
    c = cache.Cache(cfg.cache.dir)
    plain, flipped = (c.get("latents", s.key)["latents"] for s in plan.latents[:2])
    assert plan.latents[0].flip is False and plan.latents[1].flip is True
    assert not torch.equal(plain, flipped)


def test_corrupt_entry_is_detected_reported_and_replaced(setup) -> None:
    _, _, load = setup
    plan, _ = fill(load)
    cfg, family, model_dir = load()
    c = cache.Cache(cfg.cache.dir)
    victim = c.path("latents", plan.latents[0].key)
    raw = bytearray(victim.read_bytes())
    raw[-4:] = b"\x00\x01\x02\x03"  # flip bytes inside the tensor data
    victim.write_bytes(bytes(raw))
    with pytest.raises(cache.CorruptEntry, match="does not match its checksum"):
        c.get("latents", plan.latents[0].key)
    report = cache.verify(cfg, family, model_dir, "cpu")
    assert report.ok == 5 and len(report.corrupt) == 1 and str(plan.latents[0].item.path) in report.corrupt[0]
    samples = cache.load_samples(cfg, family, model_dir, "cpu", plan)  # drops and re-encodes the entry
    assert len(samples) == 3
    c.get("latents", plan.latents[0].key)  # readable again


def test_crash_while_writing_leaves_no_entry(setup, monkeypatch) -> None:
    _, _, load = setup
    import safetensors.torch

    def crash(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    from imglora.data.cache import CachingInterrupted

    with pytest.raises(CachingInterrupted, match=r"interrupted while caching: 0 of 6 entries were written and are "
                                                 r"kept in .*; the rest are encoded next time") as err:
        fill(load)  # (a Ctrl-C in the middle of writing the first entry)
    assert err.value.exit_code == 130
    cfg = load()[0]
    leftovers = [p for p in Path(cfg.cache.dir).rglob("*") if p.is_file()]
    assert leftovers == []
    monkeypatch.undo()
    _, stats = fill(load)
    assert stats.latents_encoded == 3


def test_verify_reports_stale_entries(setup) -> None:
    data, _, load = setup
    fill(load)
    (data / "04_wall.txt").write_text("sks toy, a ball by a wall")
    cfg, family, model_dir = load()
    report = cache.verify(cfg, family, model_dir, "cpu")
    assert len(report.stale) == 1 and "a striped ball in front of a red brick wall" in report.stale[0]
    assert report.missing == ["text of 'sks toy, a ball by a wall'"]


def test_cli_prints_counts_and_writes_record(setup) -> None:
    _, overrides, load = setup
    args = ["cache-latents", str(PRESET)] + [x for o in overrides for x in ("--set", o)]
    r1 = CliRunner().invoke(main, args)
    assert r1.exit_code == 0, r1.output
    assert "latents: 3 encoded, 0 reused; text: 3 encoded, 0 reused;" in r1.output
    r2 = CliRunner().invoke(main, args)
    assert "latents: 0 encoded, 3 reused; text: 0 encoded, 3 reused;" in r2.output
    cfg = load()[0]
    recs = record.read_records(cfg.run_dir, "cache-latents")
    assert len(recs) == 2
    rec = recs[-1]
    assert rec["environment"]["torch"] == torch.__version__.split("+")[0] or rec["environment"]["torch"]
    for pkg in ("diffusers", "transformers", "peft", "optimum-quanto", "imglora"):
        assert rec["environment"][pkg]
    assert set(rec["phases"]) >= {"resolve_model", "scan", "cache"}
    assert any(k.endswith(".safetensors") for k in rec["model_checksums"])
    assert len(rec["dataset_version"]) == 64 and rec["config"]["model"]["path"] == "tiny:sdxl"
    verify = CliRunner().invoke(main, args + ["--verify"])
    assert verify.exit_code == 0 and "6 entries ok, 0 missing, 0 stale, 0 corrupt" in verify.output


def test_cli_bad_dataset_names_every_file(setup, tmp_path: Path) -> None:
    data, overrides, _ = setup
    (data / "zero.png").write_bytes(b"")
    (data / "zero.txt").write_text("x")
    (data / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
    (data / "broken.txt").write_text("x")
    Image.new("RGB", (64, 64), "red").save(data / "nocaption.png")
    args = ["cache-latents", str(PRESET)] + [x for o in overrides for x in ("--set", o)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1
    for name in ("zero.png", "broken.jpg", "nocaption.png"):
        assert name in r.output
    assert "Traceback" not in r.output


def test_bucket_geometry_the_model_cannot_take_is_refused_before_encoding(setup) -> None:
    from imglora.errors import ConfigError

    _, overrides, _ = setup
    preset = REPO / "presets" / "tiny-flux.toml"
    with pytest.raises(ConfigError, match="--set data.bucket_step: 8 must be a multiple of 16 for the flux family"):
        load_config(preset, [*overrides, "data.bucket_step=8"])  # the config refuses it (as `imglora config` does)
    # A configuration built without the loader is refused by the scan, with the same check.
    cfg = load_config(preset, overrides)
    with pytest.raises(ConfigError, match=r"tiny-flux.toml: data.bucket_step: 8 must be a multiple of 16 for the flux"):
        cache.scan(cfg.replace(data={"bucket_step": 8}), get_family("flux"))
    unbucketed = cfg.replace(data={"buckets": False, "resolution": 200})
    with pytest.raises(ConfigError, match="data.resolution: 200 must be a multiple of 16 with data.buckets = false"):
        cache.scan(unbucketed, get_family("flux"))


def test_non_finite_encodings_are_never_cached(setup, monkeypatch) -> None:
    from imglora.errors import DataError
    from imglora.families import sdxl

    _, _, load = setup
    real = sdxl.SdxlFamily.encode_image

    def overflow(self, vae, pixels, **kw):
        out = real(self, vae, pixels, **kw)
        out["latents"][0, 0, 0] = float("inf")
        return out

    monkeypatch.setattr(sdxl.SdxlFamily, "encode_image", overflow)
    with pytest.raises(DataError, match="encoding gave NaN or infinite values .*use \"bf16\" or \"fp32\""):
        fill(load)
    cfg = load()[0]
    assert not list((Path(cfg.cache.dir) / "latents").rglob("*.safetensors"))


def test_an_entry_replaced_by_another_valid_entry_is_caught_reported_and_reencoded(setup) -> None:
    _, _, load = setup
    plan, _ = fill(load)
    cfg, family, model_dir = load()
    c = cache.Cache(cfg.cache.dir)
    a, b = plan.latents[0], plan.latents[1]
    c.path("latents", a.key).write_bytes(c.path("latents", b.key).read_bytes())  # valid file, wrong place
    with pytest.raises(cache.CorruptEntry, match="holds another entry"):
        c.get("latents", a.key)
    report = cache.verify(cfg, family, model_dir, "cpu")
    assert len(report.corrupt) == 1 and str(a.item.path) in report.corrupt[0] and "another entry" in report.corrupt[0]
    data = cache.prepare_images(cfg, family, model_dir, "cpu")
    assert "cache 1 encoded / 5 reused" in data.summary  # the re-encoded entry is counted as encoded
    assert c.get("latents", a.key)["latents"].shape == c.get("latents", b.key)["latents"].shape


def test_captions_longer_than_the_encoder_reads_are_named_on_every_run(setup) -> None:
    data, _, load = setup
    (data / "02_grass.txt").write_text("sks toy, " + " ".join(["a striped ball on green grass"] * 20))
    cfg, family, model_dir = load()
    for _ in range(2):  # the second run encodes nothing and still knows (the entry's header)
        warnings = cache.prepare_images(cfg, family, model_dir, "cpu").warnings
        long = [w for w in warnings if "longer than the text encoder reads" in w]
        assert len(long) == 1 and "02_grass.jpg" in long[0] and "of 77 tokens" in long[0], warnings


@pytest.mark.parametrize("damage", ['{"format": 2, "latents": [{"image": "/x', '[]', '{"latents": [1], "texts": []}'])
def test_a_corrupt_manifest_is_named_and_rebuilt_by_verify(setup, damage) -> None:
    _, overrides, load = setup
    fill(load)
    cfg = load()[0]
    manifest = cache.manifest_path(cfg)
    good = json.loads(manifest.read_text())
    manifest.write_text(damage)
    args = ["cache-latents", str(PRESET)] + [x for o in overrides for x in ("--set", o)]
    r = CliRunner().invoke(main, args + ["--verify"])
    assert r.exit_code == 0, r.output
    assert f"warning: the cache manifest {manifest} is corrupt (" in r.output
    assert "rebuilt from the current data and models" in r.output and "Traceback" not in r.output
    assert "6 entries ok, 0 missing, 0 stale, 0 corrupt" in r.output  # every entry checked by its checksum
    assert json.loads(manifest.read_text()) == good  # rebuilt: what the last fill wrote


def test_a_corrupt_manifest_loses_no_entry_and_a_corrupt_entry_is_still_found(setup) -> None:
    _, overrides, load = setup
    plan, _ = fill(load)
    cfg = load()[0]
    manifest = cache.manifest_path(cfg)
    manifest.write_bytes(b"\x00" * 40)
    victim = cache.Cache(cfg.cache.dir).path("latents", plan.latents[0].key)
    raw = bytearray(victim.read_bytes())
    raw[-4:] = b"\x00\x01\x02\x03"
    victim.write_bytes(bytes(raw))
    args = ["cache-latents", str(PRESET)] + [x for o in overrides for x in ("--set", o)]
    r = CliRunner().invoke(main, args + ["--verify"])
    assert r.exit_code == 1 and "5 entries ok, 0 missing, 0 stale, 1 corrupt" in r.output, r.output
    assert f"the cache manifest {manifest} is corrupt" in r.output


def test_fill_names_a_corrupt_manifest_rebuilds_it_and_reencodes_nothing(setup, caplog) -> None:
    """cache-latents and train fill the cache through fill_cache: the same warning, nothing lost."""
    _, _, load = setup
    fill(load)
    manifest = cache.manifest_path(load()[0])
    good = json.loads(manifest.read_text())
    manifest.write_text("{not json")
    with caplog.at_level("WARNING"):
        _, stats = fill(load)
    assert (stats.latents_encoded, stats.texts_encoded, stats.latents_reused, stats.texts_reused) == (0, 0, 3, 3)
    assert f"the cache manifest {manifest} is corrupt (" in caplog.text and "rebuilt" in caplog.text
    assert json.loads(manifest.read_text()) == good
    caplog.clear()
    with caplog.at_level("WARNING"):
        fill(load)
    assert "manifest" not in caplog.text  # said once, when it was found

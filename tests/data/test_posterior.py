"""cache.latents: the VAE posterior's mean and standard deviation cached together ("sample", the
default: every use of an image draws a fresh latent, as diffusers' training scripts do), or its
mean alone ("mean"); either way keyed in the cache, and a draw is a pure function of the run's
seed, the micro-batch and the row (resume and any number of processes draw the same)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from imglora.commands.common import load_config
from imglora.data import cache
from imglora.data.batches import Batcher
from imglora.data.buckets import fit_to_bucket
from imglora.data.images import open_image
from imglora.families import registry
from imglora.models.resolve import resolve_model

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def cached(small_run, *extra: str):
    cfg = load_config(REPO / "presets" / "tiny-flux.toml", [*small_run(("01_sky", "03_table")), "data.flip=false",
                                                             "data.buckets=false", *extra])
    family = registry.get(cfg.model.family)
    src = resolve_model(cfg.model.path, family)
    the_plan, _ = cache.fill_cache(cfg, family, src, "cpu", progress=False)
    return cfg, family, src, the_plan, cache.load_samples(cfg, family, src, "cpu", the_plan)


def test_the_entry_holds_the_posteriors_mean_and_std_in_the_models_units(small_run) -> None:
    cfg, family, src, plan, _ = cached(small_run)
    assert cfg.cache.latents == "sample"  # the default, as the references train on samples
    mean_cfg, _, _, mean_plan, _ = cached(small_run, 'cache.latents="mean"')
    assert {s.key for s in plan.latents}.isdisjoint(s.key for s in mean_plan.latents)  # keyed by the mode
    assert [t.key for t in plan.texts.values()] == [t.key for t in mean_plan.texts.values()]
    store = cache.Cache(cfg.cache.dir)
    spec = plan.latents[0]
    twin = next(s for s in mean_plan.latents if s.image_sha256 == spec.image_sha256)
    e, m = store.get("latents", spec.key), store.get("latents", twin.key)
    assert "latents_std" not in m and torch.equal(e["latents"], m["latents"])  # the same mean either way
    # FLUX's VAE is (x - shift) * scale: a sample's latent is mean + scale * std * noise.
    vae = family.load_vae(src, CPU, torch.float32)
    fit = fit_to_bucket(open_image(spec.item.path), spec.item.bucket, crop=spec.crop, seed=spec.crop_seed)
    pixels = torch.from_numpy(np.asarray(fit.image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)[None]
    with torch.no_grad():
        std = vae.encode(pixels).latent_dist.std[0] * vae.config.scaling_factor
    # Two VAE instances on the same pixels: float32 rounding may differ in the last bits.
    torch.testing.assert_close(e["latents_std"], std, rtol=1e-5, atol=1e-7)
    assert torch.all(e["latents_std"] > 0)


def test_each_use_draws_anew_and_a_draw_depends_only_on_seed_batch_and_row(small_run) -> None:
    _, family, _, _, got = cached(small_run)
    batcher = Batcher(got, batch_size=1, seed=5, collate=family.collate)
    first = batcher.batch(0, CPU)
    assert "latents_std" not in first
    assert torch.equal(first["latents"], Batcher(got, 1, 5, family.collate).batch(0, CPU)["latents"])  # pure
    assert not torch.equal(first["latents"], Batcher(got, 1, 6, family.collate).batch(0, CPU)["latents"])
    ref = batcher.ref(0)
    entry = got[ref.indices[0]].variants[ref.variants[0]]
    noise = (first["latents"][0] - entry["latents"]) / entry["latents_std"]
    assert abs(float(noise.mean())) < 0.2 and 0.8 < float(noise.std()) < 1.2  # a standard normal draw
    # the same image in the next epoch: another draw
    later = next(i for i in range(batcher.per_epoch, 2 * batcher.per_epoch) if batcher.ref(i).indices == ref.indices)
    assert not torch.equal(batcher.batch(later, CPU)["latents"], first["latents"])
    # one process's share of a batch draws what the whole batch draws for those rows
    two = Batcher(got, batch_size=2, seed=5, collate=family.collate)
    whole = two.batch(0, CPU)
    part = two.part(0, CPU, rank=1, world=2)
    assert list(part.positions) == [1] and torch.equal(part.batch["latents"][0], whole["latents"][1])
    # with cache.latents = "mean", batches hold the mean
    _, fam, _, _, means = cached(small_run, 'cache.latents="mean"')
    b = Batcher(means, 1, 5, fam.collate)
    assert torch.equal(b.batch(0, CPU)["latents"][0], means[b.ref(0).indices[0]].variants[0]["latents"])

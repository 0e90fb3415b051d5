"""Several data sets, caption options, regularization and masked loss on the tiny models: each
option changes what it should and nothing else, no step runs an encoder, a resumed or extended run
with every option on is bit-identical to an uninterrupted one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from imglora.training import checkpoint
from imglora.runs import record
from imglora.commands.common import load_config
from imglora.commands.train import train
from imglora.data import cache
from imglora.data.batches import Batcher
from imglora.families import get_family
from imglora.families._shared.diffusers_image import ADAPTER_FILE
from imglora.models.resolve import resolve_model
from imglora.memory.wrap import resolve_swap
from loading import load_tiny

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "sample_datasets"


def quiet(_: str) -> None:
    pass


def prepared(cfg):
    family = get_family(cfg.model.family)
    src = resolve_model(cfg.model.path, family)
    return family, src, family.prepare_data(cfg, src, torch.device("cpu"))


@pytest.fixture(scope="module")
def every_option(tmp_path_factory) -> Path:
    """A preset with every option of the issue on: four sets (masks, tags shuffled and dropped at a
    second resolution, regularization, alpha masks), caption dropout, flips, random crops, batch 2."""
    root = tmp_path_factory.mktemp("every")
    alpha = root / "alpha"
    alpha.mkdir()
    for k in range(2):  # drawn the toy's way would be nicer; a half-transparent square is enough here
        pixels = np.zeros((160, 128, 4), dtype=np.uint8)
        pixels[..., :3] = (40 + 80 * k, 160, 90)
        pixels[:, : 64 + 32 * k, 3] = 255
        Image.fromarray(pixels).save(alpha / f"cut_{k}.png")
        (alpha / f"cut_{k}.txt").write_text(f"sks toy, cut out {k}")
    text = (SAMPLES.parent / "presets" / "tiny-datasets.toml").read_text()
    text = text.replace('extends = "tiny-sdxl.toml"', f'extends = {json.dumps(str(REPO / "presets" / "tiny-sdxl.toml"))}')
    text = text.replace('"sample_datasets/', f'"{SAMPLES}/')
    text = text.replace("prior_loss_weight = 1.0", "prior_loss_weight = 0.5").replace("caption_dropout = 0.1",
                                                                                      "caption_dropout = 0.2")
    text = text.replace('name = "toy"\n', 'name = "toy"\nflip = true\ncrop = "random"\n')
    text = text.replace("[train]", f"""[[data.sets]]
name = "cut outs"
dir = {json.dumps(str(alpha))}
alpha_mask = true
resolution = 128

[cache]
dir = {json.dumps(str(root / "cache"))}

[run]
output_dir = {json.dumps(str(root / "runs"))}

[train]
batch_size = 2
scheduler = "constant"
warmup_steps = 0
keep_checkpoints = 2
log_every = 1""")
    text = text.replace("max_steps = 60\ncheckpoint_every = 20", "max_steps = 6\ncheckpoint_every = 3")
    preset = root / "every.toml"
    preset.write_text(text)
    return preset


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "adapter" / ADAPTER_FILE))


@pytest.mark.slow
def test_every_option_trains_resumes_and_extends_bit_for_bit_and_no_step_encodes(every_option, monkeypatch) -> None:
    from imglora.families import sdxl

    encoded: list[str] = []
    real_encode = sdxl.SdxlFamily.encode_text
    monkeypatch.setattr(sdxl.SdxlFamily, "encode_text",
                        lambda self, enc, caption, n: encoded.append(caption) or real_encode(self, enc, caption, n))
    seen: list[tuple[list, dict]] = []
    real_batch = Batcher.batch

    def spy(self, m, device):
        out = real_batch(self, m, device)
        encoded.append("<step>")
        seen.append(([self.samples[i] for i in self.ref(m).indices], out))
        return out

    monkeypatch.setattr(Batcher, "batch", spy)
    cfg = load_config(every_option)
    result = train(cfg, out=quiet)
    reference = adapter(result.run_dir)
    # Every text was encoded before the first step, none after; each was a cached variant.
    first_step = encoded.index("<step>")
    assert all(c == "<step>" for c in encoded[first_step:]) and len(seen) == 6
    assert len(set(encoded[:first_step])) == len(encoded[:first_step]) > 20  # each text once
    for samples, batch in seen:
        for row, s in zip(batch["prompt_embeds"], samples):
            options = [t["prompt_embeds"] for t in s.texts or s.variants] + \
                ([s.empty_text["prompt_embeds"]] if s.empty_text else [])
            assert any(torch.equal(row, o) for o in options)
    assert any("loss_mask" in b for _, b in seen) and any("loss_weight" in b for _, b in seen)
    rec = record.read_records(result.run_dir, "train")[-1]
    assert [(s["name"], s["images"], s["masks"]) for s in rec["dataset_sets"]] == [
        ("toy", 8, 8), ("toy tags", 8, 0), ("balls", 4, 0), ("cut outs", 2, 2)]

    # Interrupted after update 3: the resumed run ends where the uninterrupted one did, bit for bit.
    shutil.rmtree(checkpoint.step_dir(result.run_dir, 6))
    shutil.rmtree(result.run_dir / "adapter")
    encoded.clear()
    lines: list[str] = []
    train(cfg, resume=True, out=lines.append)
    assert any("resuming from" in x and "step-000003" in x for x in lines)
    assert encoded.count("<step>") == 3 and len(encoded) == 3  # the cache served every text
    resumed = adapter(result.run_dir)
    assert resumed.keys() == reference.keys() and all(torch.equal(resumed[k], reference[k]) for k in reference)

    # A finished run of 3 updates extended to 6 (constant schedule) equals the 6-update run.
    short = ["run.name=\"extended\"", "train.max_steps=3"]
    train(load_config(every_option, short), out=quiet)
    lines.clear()
    extended = train(load_config(every_option, [short[0], "train.max_steps=6"]), resume=True, out=lines.append)
    assert any("with a new length: 3 -> 6 updates" in x for x in lines)
    assert extended.steps_done == 6
    longer = adapter(extended.run_dir)
    assert all(torch.equal(longer[k], reference[k]) for k in reference)


def test_caption_dropout_1_trains_only_on_the_empty_caption_and_encodes_nothing_else(small_run) -> None:
    cfg = load_config(REPO / "presets" / "tiny-sdxl.toml", [*small_run(), "data.caption_dropout=1.0"])
    family, src, data = prepared(cfg)
    the_plan = cache.plan(cfg, family, src, "cpu")
    assert list(the_plan.texts) == [""]  # the captions themselves are never encoded
    empty = cache.Cache(cfg.cache.dir).get("text", the_plan.texts[""].key)
    batcher = Batcher(data.samples, 1, seed=0, collate=family.collate)
    for m in range(2 * batcher.per_epoch):
        batch = batcher.batch(m, torch.device("cpu"))
        assert torch.equal(batch["prompt_embeds"][0], empty["prompt_embeds"])
        assert torch.equal(batch["pooled_prompt_embeds"][0], empty["pooled_prompt_embeds"])
    plain = load_config(REPO / "presets" / "tiny-sdxl.toml", small_run())
    assert [s.key for s in cache.plan(plain, family, src, "cpu").latents] == [s.key for s in the_plan.latents]


def test_a_mask_zeroing_the_right_half_is_cached_with_the_latents_and_stops_its_gradient(small_run, tmp_path) -> None:
    overrides = small_run(("01_sky", "04_wall"))
    masks = tmp_path / "masks"
    masks.mkdir()
    for name in ("01_sky", "04_wall"):
        w, h = Image.open(tmp_path / "data" / f"{name}.png").size
        half = np.full((h, w), 255, dtype=np.uint8)
        half[:, w // 2:] = 0
        Image.fromarray(half).save(masks / f"{name}.png")
    plain_cfg = load_config(REPO / "presets" / "tiny-sdxl.toml", overrides)
    cfg = load_config(REPO / "presets" / "tiny-sdxl.toml", [*overrides, f"data.mask_dir={json.dumps(str(masks))}"])
    family, src, data = prepared(cfg)
    plain_keys = {s.key for s in cache.plan(plain_cfg, family, src, "cpu").latents}
    assert plain_keys.isdisjoint(s.key for s in cache.plan(cfg, family, src, "cpu").latents)  # the mask is in the key
    mask = data.samples[0].variants[0]["loss_mask"]
    assert mask.shape == (1, 16, 16) and mask[..., 8:].eq(0).all() and mask[..., :8].eq(1).all()
    trainable = load_tiny(family, src, cfg)
    batch = family.collate([s.entry() for s in data.samples])
    grads = _prediction_grad(trainable, batch, lambda out: out.sample)
    assert grads[..., 8:].abs().max() == 0 and grads[..., :8].abs().min() > 0


def test_flux_trains_the_sets_and_weights_its_packed_loss_by_the_mask(every_option, tmp_path) -> None:
    text = every_option.read_text().replace(str(REPO / "presets" / "tiny-sdxl.toml"),
                                            str(REPO / "presets" / "tiny-flux.toml"))
    text = text.replace("resolution = 192", "resolution = 160")
    preset = tmp_path / "flux.toml"
    preset.write_text(text.replace("[train]", "[memory]\nblocks_to_swap = 0\n\n[train]"))
    cfg = load_config(preset, ["train.max_steps=2", "train.checkpoint_every=0", f"cache.dir={json.dumps(str(tmp_path / 'c'))}"])
    result = train(cfg, out=quiet)
    assert result.adapter.is_file() and not result.interrupted
    family, src, data = prepared(cfg)
    # fp8 off here: the gradient of the prediction needs no quantized weight to take a gradient
    swap = resolve_swap(family, cfg.replace(memory={"fp8": False}), src)
    trainable = family.load_trainable(src, cfg.replace(memory={"fp8": False}), torch.device("cpu"), torch.float32, swap)
    masked = [s for s in data.samples if "loss_mask" in s.variants[0] and s.bucket == data.samples[0].bucket][:2]
    batch = family.collate([s.entry() for s in masked])
    grads = _prediction_grad(trainable, batch, lambda out: out[0])
    from imglora.families.flux.model import pack_latents

    keep = pack_latents(batch["loss_mask"].expand(-1, batch["latents"].shape[1], -1, -1).contiguous())
    assert grads[keep == 0].abs().max() == 0 and (grads[keep > 0] != 0).float().mean() > 0.99


def _prediction_grad(trainable, batch, prediction) -> torch.Tensor:
    """d loss / d the model's prediction, for one forward of the family's own loss."""
    held: list[torch.Tensor] = []
    trainable.model.requires_grad_(True)  # loaded frozen (a base model); the prediction needs a graph here

    def hook(module, args, output):
        pred = prediction(output)
        pred.retain_grad()
        held.append(pred)

    handle = trainable.model.register_forward_hook(hook)
    try:
        trainable.loss(batch, torch.Generator().manual_seed(0)).backward()
    finally:
        handle.remove()
    return held[0].grad

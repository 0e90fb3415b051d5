"""Several data sets in one preset: the config ([[data.sets]] and its inheritance), the scan of each
set, loss masks and caption variants; no model is loaded here (tests/commands/test_datasets.py
trains)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from imglora.commands.common import load_config
from imglora.config import field_help
from imglora.data import captions
from imglora.data.buckets import fit_to_bucket
from imglora.data.scan import data_version, scan, set_records, split_holdout
from imglora.errors import ConfigError, DataError
from imglora.families import get_family

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-datasets.toml"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def image(path: Path, size=(128, 128), mode="RGB", colour=(90, 120, 200), caption: str | None = "a caption"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, colour).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)
    return path


def preset(tmp_path: Path, sets: str, data: str = "") -> Path:
    return write(tmp_path / "p.toml", f"""
version = 2
extends = {json.dumps(str(REPO / "presets" / "tiny-sdxl.toml"))}
[data]
{data}
{sets}
[cache]
dir = {json.dumps(str(tmp_path / "cache"))}
""")


# -- configuration -----------------------------------------------------------------------------


def test_sets_take_what_they_leave_out_from_data_and_old_presets_are_one_set() -> None:
    cfg = load_config(PRESET)
    toy, tags, balls = cfg.data.all_sets
    assert [s.name for s in cfg.data.all_sets] == ["toy", "toy tags", "balls"]
    assert toy.trigger_word == tags.trigger_word == "sks toy"  # from [data]
    assert (toy.caption_dropout, tags.caption_dropout, balls.caption_dropout) == (0.1, 0.1, 0.0)
    assert (toy.resolution, tags.resolution, cfg.data.max_resolution) == (128, 192, 192)
    assert tags.shuffle_variants == 4 and toy.shuffle_variants == 8  # the default where not set
    assert balls.regularization and not toy.regularization
    old = load_config(REPO / "presets" / "tiny-sdxl.toml")
    (one,) = old.data.all_sets
    assert old.data.sets == [] and one.dir == old.data.dir == "sample_datasets/sks_toy" and one.resolution == 128


def test_set_problems_name_the_table_and_key_all_at_once(tmp_path: Path) -> None:
    p = preset(tmp_path, """
[[data.sets]]
dir = "a"
caption_extension = ".cap"
reg_ratio = 2.0
[[data.sets]]
dir = "b"
mask_dir = "m"
alpha_mask = true
class_caption = "a toy"
shuffle_tags = "yes"
""")
    with pytest.raises(ConfigError) as exc:
        load_config(p, ["data.sets[0].repeats=0", "data.sets[5].repeats=2"])
    problems = exc.value.problems
    assert f"{p}: data.sets[0].caption_extension: unknown key (that is another trainer's name; imglora's is " \
           "caption_ext)" in problems
    assert f"{p}: data.sets[0].reg_ratio: unknown key (it applies to every set: set it in [data])" in problems
    assert "--set data.sets[0].repeats: must be at least 1, got 0" in problems
    assert any(x.startswith("--set data.sets[5].repeats: there is no sets[5] (the preset has 2") for x in problems)
    assert f'{p}: data.sets[1].shuffle_tags: expected true or false, got the string "yes"' in problems
    assert len(problems) == 5  # every problem at once; the cross-field ones come once the types are right
    with pytest.raises(ConfigError) as exc:
        load_config(p, ["data.sets[0].caption_ext=''", "data.sets[1].shuffle_tags=true"])
    msg = str(exc.value)
    assert "data.sets[1].mask_dir: a set takes its loss masks from mask_dir or from the images' alpha" in msg
    assert "data.sets[1].class_caption: only a regularization set (regularization = true) uses a class" in msg


def test_only_regularization_sets_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="every set is a regularization set, so there is nothing to train on"):
        load_config(preset(tmp_path, "", data="regularization = true\nclass_caption = \"a toy\""))


def test_keys_document_every_set_option() -> None:
    rows = {k: h for k, _, h in field_help()}
    for key in ("caption_dropout", "shuffle_tags", "keep_tokens", "tag_dropout", "shuffle_variants", "regularization",
                "class_caption", "mask_dir", "alpha_mask", "repeats", "resolution", "caption_ext"):
        assert rows[f"data.{key}"].endswith("Also per [[data.sets]] table."), key
    assert {"data.sets", "data.prior_loss_weight", "data.reg_ratio"} <= set(rows)
    assert "Also per" not in rows["data.reg_ratio"]


def test_resume_compares_sets_item_by_item_and_their_folders_may_move() -> None:
    from imglora.training import checkpoint
    from imglora.families import registry

    cfg = load_config(PRESET)
    moved = load_config(PRESET, ['data.sets[0].dir="elsewhere/sks_toy"', 'data.sets[0].mask_dir="elsewhere/m"'])
    assert checkpoint.config_differences(cfg.to_dict(), moved, registry) == []
    changed = load_config(PRESET, ["data.sets[1].keep_tokens=2"])
    assert checkpoint.config_differences(cfg.to_dict(), changed, registry) == [
        "data.sets[1].keep_tokens: 1 in the checkpoint, 2 now"]


# -- scanning ------------------------------------------------------------------------------------


def test_each_set_scans_with_its_own_settings_and_the_record_lists_them(tmp_path: Path) -> None:
    cfg = load_config(PRESET)
    family = get_family("sdxl")
    scanned = scan(cfg, family)
    by_set = [[i for i in scanned.items if i.set_index == k] for k in range(3)]
    assert [len(x) for x in by_set] == [8, 8, 4]
    assert all(i.mask is not None and i.mask.parent.name == "sks_toy_masks" for i in by_set[0])
    assert all(i.caption.startswith("sks toy, striped ball, red and yellow") for i in by_set[1])  # .tags
    assert all(not i.caption.startswith("sks toy") for i in by_set[2])  # no trigger word on the class images
    assert max(max(i.bucket) for i in by_set[0]) <= 128 < max(max(i.bucket) for i in by_set[1])
    rows = set_records(cfg, scanned.items)
    assert [(r["name"], r["images"], r["repeats"], r["samples_per_epoch"], r["masks"]) for r in rows] == [
        ("toy", 8, 2, 16, 8), ("toy tags", 8, 1, 8, 0), ("balls", 4, 1, 24, 0)]  # 24 = one per training sample
    assert all(len(r["version"]) == 64 for r in rows) and rows[0]["version"] != rows[1]["version"]
    # A single-set preset keeps the version it always had.
    one = load_config(REPO / "presets" / "tiny-sdxl.toml")
    from imglora.data.dataset import dataset_version
    items = split_holdout(one, scan(one, family))[0].items
    assert data_version(one, items) == dataset_version(items)


def test_bad_sets_are_named_together(tmp_path: Path) -> None:
    good, reg, masks, empty = (tmp_path / n for n in ("good", "reg", "masks", "empty"))
    image(good / "a.png")
    image(good / "b.png")
    image(good / "c.png", caption="one, two")
    Image.new("L", (64, 64), 255).save(write(masks / "a.png", "").with_name("a.png"))  # wrong size
    Image.new("L", (128, 128), 0).save(masks / "b.png")  # all black
    image(reg / "r.png", caption=None)
    empty.mkdir()
    p = preset(tmp_path, f"""
[[data.sets]]
dir = {json.dumps(str(good))}
mask_dir = {json.dumps(str(masks))}
shuffle_tags = true
keep_tokens = 3
[[data.sets]]
dir = {json.dumps(str(reg))}
regularization = true
[[data.sets]]
name = "nothing"
dir = {json.dumps(str(empty))}
""")
    with pytest.raises(DataError) as exc:
        scan(load_config(p), get_family("sdxl"))
    problems = exc.value.problems
    assert any(x.startswith("set 'good': ") and "a.png: the mask is 64x64 but its image a.png is 128x128" in x
               for x in problems)
    assert any(x.startswith("set 'good': ") and "b.png: the mask is all black" in x for x in problems)
    assert any(x.startswith("set 'reg': ") and "1 regularization image(s) have no caption and the set has no class "
               "caption: r.png; set data.sets[1].class_caption" in x for x in problems)
    assert any(x.startswith("set 'nothing': ") and "no images found" in x for x in problems)
    assert len(problems) == 4
    # Fixed: a caption for the class images, a good mask, an image; what remains are warnings.
    Image.new("L", (128, 128), 255).save(masks / "a.png")
    (masks / "b.png").unlink()
    image(empty / "e.png")
    scanned = scan(load_config(p, ['data.sets[1].class_caption="a photo"']), get_family("sdxl"))
    assert any("2 image(s) have no mask in" in w and "b.png, c.png" in w for w in scanned.warnings)
    assert any("3 caption(s) have no more comma-separated tags than keep_tokens = 3" in w for w in scanned.warnings)
    assert [i.caption for i in scanned.items if i.set_index == 1] == ["a photo"]


def test_alpha_masks(tmp_path: Path) -> None:
    root = tmp_path / "alpha"
    image(root / "clear.png", mode="RGBA", colour=(10, 20, 30, 0))
    image(root / "opaque.png")
    half = np.zeros((128, 128, 4), dtype=np.uint8)
    half[:, :64, 3] = 255
    Image.fromarray(half).save(root / "half.png")
    root.joinpath("half.txt").write_text("half")
    p = preset(tmp_path, "", data=f"dir = {json.dumps(str(root))}\nalpha_mask = true")
    with pytest.raises(DataError, match="clear.png: the image is fully transparent"):
        scan(load_config(p), get_family("sdxl"))
    (root / "clear.png").unlink()
    scanned = scan(load_config(p), get_family("sdxl"))
    assert any("1 image(s) have no alpha channel and train on every pixel" in w for w in scanned.warnings)


def test_a_mask_is_resized_cropped_and_flipped_with_its_image() -> None:
    img = np.zeros((100, 200, 3), dtype=np.uint8)
    img[:, 100:] = 255  # right half white
    mask = Image.fromarray(img[..., 0])
    fit = fit_to_bucket(Image.fromarray(img), (64, 64), crop="random", seed=3, mask=mask)
    assert fit.mask.size == (64, 64)
    np.testing.assert_array_equal(np.asarray(fit.mask) > 127, np.asarray(fit.image)[..., 0] > 127)
    flipped = fit.flipped()
    np.testing.assert_array_equal(np.asarray(flipped.mask), np.asarray(fit.mask)[:, ::-1])


# -- caption variants ----------------------------------------------------------------------------


def test_caption_variants_shuffle_only_after_keep_tokens_and_are_the_same_every_run() -> None:
    caption = "sks toy, a, b, c, d, e"
    shuffled = captions.variants(caption, keep_tokens=1, shuffle=True, tag_dropout=0.0, k=8)
    assert len(shuffled) == 8 and len(set(shuffled)) > 1
    for v in shuffled:
        tags = captions.tags(v)
        assert tags[0] == "sks toy" and sorted(tags[1:]) == ["a", "b", "c", "d", "e"]
    assert captions.variants(caption, 1, True, 0.0, 12)[:8] == shuffled  # more variants keep the first ones
    dropped = captions.variants(caption, 2, False, 0.5, 16)
    assert all(captions.tags(v)[:2] == ["sks toy", "a"] for v in dropped)
    assert all(set(captions.tags(v)) <= {"sks toy", "a", "b", "c", "d", "e"} for v in dropped)
    assert any(len(captions.tags(v)) < 6 for v in dropped) and any("c, d" in v for v in dropped)  # order kept
    assert captions.variants(caption, 1, False, 0.0, 8) == (caption,)  # neither option: the caption itself

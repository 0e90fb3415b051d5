"""dataset.py: scanning a folder into items, reporting every problem at once, dataset_version."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from imglora.data.buckets import assign_bucket, make_buckets
from imglora.data.dataset import DatasetItem, dataset_version, scan_dataset
from imglora.errors import DataError

SMALL = dict(resolution=128, step=16, min_side=64)  # tiny buckets keep the tests fast


def _image(path: Path, size=(96, 64), caption: str | None = "a ball") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (200, 30, 30)).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def _truncated_png(path: Path) -> Path:
    buf = io.BytesIO()
    Image.effect_noise((64, 64), 50).convert("RGB").save(buf, "PNG")
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    path.with_suffix(".txt").write_text("cut short", encoding="utf-8")
    return path


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "data"
    _image(root / "a.png", (96, 64), "  a red ball \n")
    _image(root / "B.JPG", (64, 96), "a tall ball")
    _image(root / "3_sks toy" / "c.webp", (64, 64), "a square ball")
    _image(root / "3_sks toy" / "nested" / "d.png")  # not searched
    _image(root / "notes" / "e.png")  # not a repeats folder
    _image(root / ".cache" / "f.png")  # hidden: ignored silently
    (root / "README.md").write_text("not an image")
    return root


def test_scan_tree(tree):
    result = scan_dataset(tree, **SMALL, default_repeats=2)
    # Sorted by path relative to the root ('3' < 'B' < 'a' in code-point order).
    assert [item.path for item in result.items] == [
        tree / "3_sks toy" / "c.webp",
        tree / "B.JPG",
        tree / "a.png",
    ]
    c, b, a = result.items
    assert (c.repeats, b.repeats, a.repeats) == (3, 2, 2)
    assert a.caption == "a red ball"  # stripped
    assert (a.size, b.size, c.size) == ((96, 64), (64, 96), (64, 64))
    buckets = make_buckets(128, 16, 64)
    assert a.bucket == assign_bucket(96, 64, buckets) and a.bucket[0] > a.bucket[1]
    assert b.bucket == (a.bucket[1], a.bucket[0])
    assert c.bucket == (128, 128)
    assert result.bucket_counts == {b.bucket: 1, c.bucket: 1, a.bucket: 1}
    assert len(result.warnings) == 2
    assert any("notes" in w and "'10_sks toy'" in w for w in result.warnings)
    assert any(str(tree / "3_sks toy" / "nested") in w for w in result.warnings)


def test_item_is_frozen(tree):
    item = scan_dataset(tree, **SMALL).items[0]
    assert isinstance(item, DatasetItem)
    with pytest.raises(AttributeError):
        item.caption = "x"


def test_without_buckets_everything_is_square(tree):
    result = scan_dataset(tree, **SMALL, use_buckets=False)
    assert {item.bucket for item in result.items} == {(128, 128)}
    assert result.bucket_counts == {(128, 128): 3}


def test_missing_caption_is_an_error_naming_the_image(tmp_path):
    image = _image(tmp_path / "a.png", caption=None)
    with pytest.raises(DataError) as info:
        scan_dataset(tmp_path, **SMALL)
    (problem,) = info.value.problems
    assert problem.startswith(f"{image}: no caption file {tmp_path / 'a.txt'}")
    assert 'data.missing_caption = "default"' in problem and "data.default_caption" in problem


def test_empty_caption_counts_as_missing(tmp_path):
    _image(tmp_path / "a.png", caption="  \n")
    with pytest.raises(DataError, match="is empty.*data.missing_caption"):
        scan_dataset(tmp_path, **SMALL)


def test_default_caption(tmp_path):
    _image(tmp_path / "a.png", caption=None)
    result = scan_dataset(tmp_path, **SMALL, missing_caption="default", default_caption="a toy")
    assert result.items[0].caption == "a toy" and result.warnings == ()

    result = scan_dataset(tmp_path, **SMALL, missing_caption="default")
    assert result.items[0].caption == ""
    (warning,) = result.warnings
    assert "1 image(s) have no caption" in warning and str(tmp_path / "a.png") in warning


def test_every_problem_in_one_error(tmp_path):
    _image(tmp_path / "good.png")
    corrupt = tmp_path / "corrupt.jpg"
    corrupt.write_bytes(b"not a jpeg at all")
    corrupt.with_suffix(".txt").write_text("x")
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    empty.with_suffix(".txt").write_text("x")
    truncated = _truncated_png(tmp_path / "truncated.png")
    uncaptioned = _image(tmp_path / "uncaptioned.png", caption=None)

    with pytest.raises(DataError) as info:
        scan_dataset(tmp_path, **SMALL)
    problems = info.value.problems
    assert len(problems) == 4
    for path, words in [
        (corrupt, "not an image"),
        (empty, "empty (0 bytes)"),
        (truncated, "truncated"),
        (uncaptioned, "no caption file"),
    ]:
        (problem,) = [p for p in problems if p.startswith(f"{path}: ")]
        assert words in problem
    assert "4 problems in the dataset" in str(info.value)


def test_bad_image_without_caption_reports_both(tmp_path):
    _image(tmp_path / "good.png")
    (tmp_path / "bad.png").write_bytes(b"junk")
    with pytest.raises(DataError) as info:
        scan_dataset(tmp_path, **SMALL)
    assert len(info.value.problems) == 2


def test_skip_bad_images_turns_them_into_warnings(tmp_path):
    good = _image(tmp_path / "good.png")
    (tmp_path / "corrupt.png").write_bytes(b"junk")
    (tmp_path / "empty.jpg").write_bytes(b"")
    truncated = _truncated_png(tmp_path / "truncated.png")

    result = scan_dataset(tmp_path, **SMALL, skip_bad_images=True)
    assert [item.path for item in result.items] == [good]
    assert len(result.warnings) == 3
    for name in ("corrupt.png", "empty.jpg", "truncated.png"):
        (warning,) = [w for w in result.warnings if w.startswith(f"{tmp_path / name}: ")]
        assert "skipped (data.skip_bad_images)" in warning
    # Header-only scanning cannot see the truncation.
    fast = scan_dataset(tmp_path, **SMALL, skip_bad_images=True, verify_images=False)
    assert truncated in [item.path for item in fast.items]


def test_all_images_skipped_is_an_error(tmp_path):
    (tmp_path / "corrupt.png").write_bytes(b"junk")
    with pytest.raises(DataError, match="no usable images") as info:
        scan_dataset(tmp_path, **SMALL, skip_bad_images=True)
    assert any("corrupt.png" in p for p in info.value.problems)


@pytest.mark.parametrize(
    "caption, expected",
    [
        ("a ball on grass", "sks toy, a ball on grass"),
        ("photo of sks toy on grass", "photo of sks toy on grass"),
        ("sks toy", "sks toy"),
        ("sks toyota on grass", "sks toy, sks toyota on grass"),  # not the trigger as a word
    ],
)
def test_trigger_word(tmp_path, caption, expected):
    _image(tmp_path / "a.png", caption=caption)
    result = scan_dataset(tmp_path, **SMALL, trigger_word="sks toy")
    assert result.items[0].caption == expected


def test_trigger_word_alone_when_caption_defaults_to_empty(tmp_path):
    _image(tmp_path / "a.png", caption=None)
    result = scan_dataset(tmp_path, **SMALL, trigger_word="sks toy", missing_caption="default")
    assert result.items[0].caption == "sks toy"
    assert "'sks toy' alone" in result.warnings[0]


def test_caption_details(tmp_path):
    _image(tmp_path / "a.png", caption=None)
    (tmp_path / "a.txt").write_bytes("\ufeffa ball".encode())  # BOM, as Notepad writes
    _image(tmp_path / "b.png", caption=None)
    (tmp_path / "b.caption").write_text("from another extension")
    (tmp_path / "b.txt").write_text("ignored")
    result = scan_dataset(tmp_path, **SMALL, caption_ext="caption", missing_caption="default")
    assert [item.caption for item in result.items] == ["", "from another extension"]

    assert scan_dataset(tmp_path, **SMALL).items[0].caption == "a ball"
    (tmp_path / "a.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(DataError, match="not UTF-8"):
        scan_dataset(tmp_path, **SMALL)


def test_other_image_formats_are_named_in_a_warning(tmp_path):
    _image(tmp_path / "a.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "b.gif")
    (warning,) = scan_dataset(tmp_path, **SMALL).warnings
    assert str(tmp_path / "b.gif") in warning and "convert it" in warning


def test_bad_roots(tmp_path):
    with pytest.raises(DataError, match="does not exist; check data.dir") as info:
        scan_dataset(tmp_path / "missing", **SMALL)
    assert str(tmp_path / "missing") in str(info.value)
    (tmp_path / "file.png").write_bytes(b"x")
    with pytest.raises(DataError, match="not a folder"):
        scan_dataset(tmp_path / "file.png", **SMALL)
    empty = tmp_path / "empty"
    (empty / "notes").mkdir(parents=True)
    with pytest.raises(DataError, match="no images found") as info:
        scan_dataset(empty, **SMALL)
    assert str(empty) in str(info.value)


def test_invalid_options(tmp_path):
    _image(tmp_path / "a.png")
    with pytest.raises(ValueError):
        scan_dataset(tmp_path, **SMALL, missing_caption="ignore")
    with pytest.raises(ValueError):
        scan_dataset(tmp_path, **SMALL, default_repeats=0)


def test_dataset_version(tree, tmp_path):
    version = dataset_version(scan_dataset(tree, **SMALL).items)
    assert len(version) == 64
    assert dataset_version(scan_dataset(tree, **SMALL).items) == version

    # The same content elsewhere has the same version (caches survive a move).
    moved = shutil.copytree(tree, tmp_path / "moved")
    assert dataset_version(scan_dataset(moved, **SMALL).items) == version

    (tree / "a.txt").write_text("a blue ball")
    changed_caption = dataset_version(scan_dataset(tree, **SMALL).items)
    assert changed_caption != version

    Image.new("RGB", (96, 64), (200, 30, 31)).save(tree / "a.png")  # one channel, one step
    changed_image = dataset_version(scan_dataset(tree, **SMALL).items)
    assert changed_image not in (version, changed_caption)

    assert dataset_version(scan_dataset(tree, **SMALL, default_repeats=2).items) != changed_image


def test_sample_dataset(sample_dataset):
    result = scan_dataset(sample_dataset, resolution=512, step=64, trigger_word="sks toy")
    assert len(result.items) == 8
    assert result.warnings == ()
    # At SDXL's 1024 px these 256-512 px images would be enlarged 2-3x: said once, naming them.
    (big,) = scan_dataset(sample_dataset, resolution=1024, step=64).warnings
    assert "enlarged more than 2x" in big and "02_grass.jpg" in big
    assert all(item.caption.startswith("sks toy, ") for item in result.items)
    assert all(256 <= side <= 512 for item in result.items for side in item.size)
    shapes = {(w > h) - (w < h) for w, h in (item.size for item in result.items)}
    assert shapes == {-1, 0, 1}  # portrait, square and landscape
    assert {item.path.suffix for item in result.items} == {".png", ".jpg"}
    total = sum(path.stat().st_size for path in sample_dataset.iterdir())
    assert total < 2 * 1024 * 1024
    assert [p.name for p in sample_dataset.iterdir() if p.is_dir()] == []


def test_sample_generator_reproduces_the_shipped_dataset(repo_root, sample_dataset, tmp_path):
    import runpy

    generator = runpy.run_path(str(repo_root / "sample_datasets" / "make_sample.py"))
    generator["main"](tmp_path)
    shipped = sorted(p.name for p in sample_dataset.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == shipped
    for name in shipped:
        if name.endswith((".txt", ".tags")):
            assert (tmp_path / name).read_text() == (sample_dataset / name).read_text()
        else:  # pixels, not bytes: JPEG and zlib encoders differ between Pillow builds
            made, ours = (np.asarray(Image.open(d / name), dtype=np.float32)
                          for d in (tmp_path, sample_dataset))
            assert made.shape == ours.shape and np.abs(made - ours).mean() < 2


def test_far_upscaled_mostly_cropped_and_shared_caption_images_get_one_warning_each(tmp_path):
    root = tmp_path / "data"
    _image(root / "ok.png", (128, 128))
    _image(root / "tiny1.png", (32, 32))     # 128 / 32 = 4x enlarged
    _image(root / "tiny2.png", (40, 40))
    _image(root / "strip.png", (2000, 100))  # fits no bucket: most of it is cropped away
    _image(root / "twice.png", (128, 128), caption="one caption")
    Image.new("RGB", (128, 128), "blue").save(root / "twice.jpg")  # same stem: reads twice.txt too
    result = scan_dataset(root, **SMALL)
    up = [w for w in result.warnings if "enlarged more than 2x" in w]
    crop = [w for w in result.warnings if "of their area to cropping" in w]
    shared = [w for w in result.warnings if "share one caption file" in w]
    assert len(up) == 1 and up[0].startswith("2 image(s)") and "tiny1.png (32x32 -> 128x128, 4.0x)" in up[0]
    assert len(crop) == 1 and crop[0].startswith("1 image(s)") and "strip.png (2000x100" in crop[0]
    assert len(shared) == 1 and "twice.jpg + twice.png share twice.txt" in shared[0]
    assert len(result.items) == 6  # warned about, still trained
    assert not any("ok.png" in w for w in result.warnings)

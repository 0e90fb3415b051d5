"""Draw the extras of the sample data: loss masks for ``sks_toy`` and a small regularization set.

- ``sks_toy_masks/<stem>.png``: one greyscale mask per ``sks_toy`` image, the same size: white on
  the ball (and a grey ring around it, weight 0.5), black elsewhere, so a masked run learns the toy
  and not the backgrounds.
- ``reg_balls/``: 4 plain striped balls of other colours, without a face, captioned as the class
  ("a striped ball, ..."): prior-preservation images for ``regularization = true``.
- ``edit_toy/`` and ``edit_toy_sources/``: 4 edit pairs for the edit-model families (``control_dir``):
  the target is an ``sks_toy`` image, its source the same image in black and white, the caption the
  instruction ("colour this black-and-white photo: <its caption>").

Pure Pillow and fixed seeds, as ``make_sample.py``. From the repository root::

    python sample_datasets/make_extras.py
"""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw

import make_sample as sample

HERE = Path(__file__).resolve().parent
SEED = 20240602

REG_SHOTS = [
    # name, size, scene, centre, radius, tilt, colours, caption
    ("ball_1.png", (256, 256), "sky", (0.5, 0.5), 0.3, 15, ((40, 90, 200), (240, 240, 240)),
     "a striped ball in a blue sky"),
    ("ball_2.png", (256, 192), "grass", (0.4, 0.65), 0.3, -30, ((30, 150, 60), (250, 220, 60)),
     "a striped ball on grass"),
    ("ball_3.png", (192, 256), "table", (0.5, 0.6), 0.3, 50, ((120, 60, 160), (250, 250, 250)),
     "a striped ball on a table"),
    ("ball_4.png", (256, 256), "wall", (0.6, 0.62), 0.25, 0, ((20, 20, 20), (230, 120, 30)),
     "a striped ball in front of a wall"),
]


def masks(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for shot in sample.SHOTS:
        width, height = shot.size
        radius = shot.radius * min(width, height)
        cx, cy = shot.center[0] * width, shot.center[1] * height
        mask = Image.new("L", shot.size, 0)
        draw = ImageDraw.Draw(mask)
        ring = radius * 1.25
        draw.ellipse((cx - ring, cy - ring, cx + ring, cy + ring), fill=128)  # near the ball: half weight
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=255)
        path = out_dir / f"{Path(shot.name).stem}.png"
        mask.save(path, optimize=True)
        print(f"wrote {path} {width}x{height}")


def regularization(out_dir: Path) -> None:
    rng = random.Random(SEED)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, size, scene, center, radius, tilt, (stripe, base), caption in REG_SHOTS:
        width, height = (side * sample.SUPERSAMPLE for side in size)
        canvas = Image.new("RGB", (width, height))
        sample.BACKGROUNDS[scene](canvas, rng)
        r = radius * min(width, height)
        cx, cy = center[0] * width, center[1] * height
        side = int(2 * r)
        bands = Image.new("RGB", (side * 2, side * 2), base)
        band_draw = ImageDraw.Draw(bands)
        band = max(side // 7, 1)
        for top in range(0, side * 2, band * 2):
            band_draw.rectangle((0, top, side * 2, top + band - 1), fill=stripe)
        bands = bands.rotate(tilt, resample=Image.Resampling.BICUBIC)
        bands = bands.crop((side // 2, side // 2, side // 2 + side, side // 2 + side))
        disc = Image.new("L", (side, side), 0)
        ImageDraw.Draw(disc).ellipse((0, 0, side - 1, side - 1), fill=255)
        canvas.paste(bands, (int(cx - r), int(cy - r)), disc)
        ImageDraw.Draw(canvas).ellipse((cx - r, cy - r, cx + r, cy + r), outline=sample.INK, width=4)
        image = canvas.resize(size, Image.Resampling.LANCZOS)
        path = out_dir / name
        image.save(path, optimize=True)
        path.with_suffix(".txt").write_text(f"{caption}\n", encoding="utf-8")
        print(f"wrote {path} {size[0]}x{size[1]}")


EDIT_STEMS = ("01_sky", "02_grass", "03_table", "04_wall")


def edit_pairs(target_dir: Path, source_dir: Path) -> None:
    target_dir.mkdir(parents=True, exist_ok=True)
    source_dir.mkdir(parents=True, exist_ok=True)
    for stem in EDIT_STEMS:
        image = next(p for p in sorted((HERE / "sks_toy").glob(f"{stem}.*")) if p.suffix != ".txt"
                     and p.suffix != ".tags")
        (target_dir / image.name).write_bytes(image.read_bytes())
        caption = image.with_suffix(".txt").read_text(encoding="utf-8").strip()
        (target_dir / f"{stem}.txt").write_text(f"colour this black-and-white photo: {caption}\n", encoding="utf-8")
        grey = Image.open(image).convert("L")  # read as RGB by the trainer, stored small
        grey.save(source_dir / f"{stem}.png", optimize=True)
        print(f"wrote {target_dir / image.name} and {source_dir / stem}.png")


if __name__ == "__main__":
    masks(HERE / "sks_toy_masks")
    regularization(HERE / "reg_balls")
    edit_pairs(HERE / "edit_toy", HERE / "edit_toy_sources")

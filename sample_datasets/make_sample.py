"""Draw the ``sks_toy`` sample dataset: one red-and-yellow striped ball with a face, 8 scenes.

Pure Pillow and a seeded ``random.Random``, so running it again gives the same pictures (byte for
byte with the same Pillow build). Usage, from the repository root::

    python sample_datasets/make_sample.py [output folder, default sample_datasets/sks_toy]
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

TRIGGER = "sks toy"
SEED = 20240601
SUPERSAMPLE = 2  # draw at twice the size, then downscale: smooth edges without antialiasing code

RED = (214, 38, 40)
YELLOW = (250, 204, 34)
INK = (30, 22, 20)


@dataclass(frozen=True)
class Shot:
    name: str  # file name; the extension picks the format
    size: tuple[int, int]  # (width, height)
    scene: str  # sky, grass, table or wall
    center: tuple[float, float]  # ball centre as fractions of width and height
    radius: float  # ball radius as a fraction of the shorter side
    tilt: int  # stripe angle in degrees
    caption: str


SHOTS = [
    # name, (width, height), scene, ball centre, ball radius, stripe tilt, caption
    Shot("01_sky.png", (512, 512), "sky", (0.5, 0.5), 0.26, 30,
         "a striped ball floating in a blue sky"),
    Shot("02_grass.jpg", (384, 512), "grass", (0.5, 0.72), 0.3, -20,
         "a striped ball on green grass"),
    Shot("03_table.jpg", (512, 384), "table", (0.36, 0.6), 0.27, 45,
         "a striped ball on a wooden table"),
    Shot("04_wall.png", (448, 448), "wall", (0.62, 0.64), 0.22, 10,
         "a striped ball in front of a red brick wall"),
    Shot("05_sky.png", (320, 480), "sky", (0.4, 0.3), 0.2, -35,
         "a small striped ball high in a blue sky with white clouds"),
    Shot("06_grass.jpg", (512, 320), "grass", (0.24, 0.68), 0.24, 60,
         "a striped ball on the left of a green lawn"),
    Shot("07_table.jpg", (480, 480), "table", (0.5, 0.55), 0.38, 0,
         "close-up of a striped ball on a wooden table"),
    Shot("08_wall.png", (512, 384), "wall", (0.74, 0.68), 0.17, -50,
         "a small striped ball on the right, brick wall behind"),
]


# The same images captioned as comma-separated tags (<stem>.tags, booru style), for a set with
# caption_ext = ".tags" and shuffle_tags; the trigger word comes first (keep_tokens = 1).
TAGS = {
    "01_sky": "blue sky, floating, clouds, centered",
    "02_grass": "green grass, outdoors, portrait",
    "03_table": "wooden table, indoors, left side",
    "04_wall": "red brick wall, concrete floor",
    "05_sky": "blue sky, white clouds, small, high up",
    "06_grass": "green lawn, left side, landscape",
    "07_table": "wooden table, close-up, indoors",
    "08_wall": "brick wall, small, right side",
}


def main(out_dir: Path) -> None:
    rng = random.Random(SEED)
    out_dir.mkdir(parents=True, exist_ok=True)
    for shot in SHOTS:
        image = render(shot, rng)
        path = out_dir / shot.name
        if path.suffix == ".jpg":
            image.save(path, quality=85)
        else:
            image.save(path, optimize=True)
        path.with_suffix(".txt").write_text(f"{TRIGGER}, {shot.caption}\n", encoding="utf-8")
        scene = TAGS[path.stem]
        path.with_suffix(".tags").write_text(f"{TRIGGER}, striped ball, red and yellow, smiling face, {scene}\n",
                                             encoding="utf-8")
        print(f"wrote {path} {image.size[0]}x{image.size[1]}")


def render(shot: Shot, rng: random.Random) -> Image.Image:
    width, height = (side * SUPERSAMPLE for side in shot.size)
    canvas = Image.new("RGB", (width, height))
    BACKGROUNDS[shot.scene](canvas, rng)
    radius = shot.radius * min(width, height)
    cx, cy = shot.center[0] * width, shot.center[1] * height
    if shot.scene != "sky":  # a contact shadow, so the ball sits on the ground
        shade = Image.new("RGBA", canvas.size, (0, 0, 0, 0))
        ImageDraw.Draw(shade).ellipse(
            (cx - radius, cy + radius * 0.8, cx + radius, cy + radius * 1.15), fill=(0, 0, 0, 90)
        )
        canvas = Image.alpha_composite(canvas.convert("RGBA"), shade).convert("RGB")
    draw_ball(canvas, (cx, cy), radius, shot.tilt)
    return canvas.resize(shot.size, Image.Resampling.LANCZOS)


def draw_ball(canvas: Image.Image, center: tuple[float, float], radius: float, tilt: int) -> None:
    cx, cy = center
    side = int(2 * radius)
    # Stripes: horizontal bands drawn oversized, rotated, cropped to the ball and masked round.
    bands = Image.new("RGB", (side * 2, side * 2), YELLOW)
    band_draw = ImageDraw.Draw(bands)
    band = max(side // 7, 1)
    for top in range(0, side * 2, band * 2):
        band_draw.rectangle((0, top, side * 2, top + band - 1), fill=RED)
    bands = bands.rotate(tilt, resample=Image.Resampling.BICUBIC)
    bands = bands.crop((side // 2, side // 2, side // 2 + side, side // 2 + side))
    mask = Image.new("L", (side, side), 0)
    ImageDraw.Draw(mask).ellipse((0, 0, side - 1, side - 1), fill=255)
    box = (int(cx - radius), int(cy - radius))
    canvas.paste(bands, box, mask)

    # Soft light from the upper left, then an outline to separate the ball from any background.
    light = Image.new("RGBA", canvas.size, (0, 0, 0, 0))
    ImageDraw.Draw(light).ellipse(
        (cx - radius * 0.7, cy - radius * 0.75, cx - radius * 0.15, cy - radius * 0.35),
        fill=(255, 255, 255, 110),
    )
    canvas.paste(Image.alpha_composite(canvas.convert("RGBA"), light).convert("RGB"))
    draw = ImageDraw.Draw(canvas)
    draw.ellipse(
        (cx - radius, cy - radius, cx + radius, cy + radius),
        outline=INK,
        width=max(int(radius / 18), 2),
    )

    # The face: two eyes with highlights and a wide smile.
    eye_w, eye_h = radius * 0.16, radius * 0.24
    for dx in (-0.32, 0.32):
        ex, ey = cx + dx * radius, cy - radius * 0.12
        draw.ellipse((ex - eye_w, ey - eye_h, ex + eye_w, ey + eye_h), fill=INK)
        glint = eye_w * 0.45
        top = ey - eye_h * 0.6
        draw.ellipse((ex - glint, top, ex + glint * 0.6, top + glint * 1.6), fill="white")
    draw.arc(
        (cx - radius * 0.45, cy - radius * 0.1, cx + radius * 0.45, cy + radius * 0.55),
        start=20,
        end=160,
        fill=INK,
        width=max(int(radius / 12), 3),
    )


def sky(canvas: Image.Image, rng: random.Random, horizon: float = 1.0) -> None:
    width, height = canvas.size
    draw = ImageDraw.Draw(canvas)
    sky_h = int(height * horizon)
    for y in range(sky_h):
        t = y / max(sky_h - 1, 1)
        draw.line((0, y, width, y), fill=(int(60 + 110 * t), int(120 + 90 * t), int(215 + 35 * t)))
    for _ in range(rng.randint(3, 5)):  # clouds: clusters of white puffs
        x, y = rng.uniform(0, width), rng.uniform(0, sky_h * 0.7)
        for _ in range(rng.randint(4, 7)):
            px, py = x + rng.uniform(-60, 60), y + rng.uniform(-15, 15)
            r = rng.uniform(25, 50)
            draw.ellipse((px - r * 1.4, py - r, px + r * 1.4, py + r), fill=(250, 250, 252))


def grass(canvas: Image.Image, rng: random.Random) -> None:
    width, height = canvas.size
    sky(canvas, rng, horizon=0.4)
    draw = ImageDraw.Draw(canvas)
    top = int(height * 0.4)
    draw.rectangle((0, top, width, height), fill=(74, 150, 58))
    for _ in range(width * 3):  # blades: short strokes in a few greens
        x, y = rng.uniform(0, width), rng.uniform(top, height)
        shade = rng.choice([(52, 120, 40), (96, 176, 70), (64, 140, 50)])
        draw.line((x, y, x + rng.uniform(-6, 6), y - rng.uniform(8, 22)), fill=shade, width=2)


def table(canvas: Image.Image, rng: random.Random) -> None:
    width, height = canvas.size
    draw = ImageDraw.Draw(canvas)
    edge = int(height * 0.45)
    draw.rectangle((0, 0, width, edge), fill=(226, 214, 190))  # plain wall behind the table
    draw.rectangle((0, edge, width, height), fill=(150, 96, 52))
    for _ in range(60):  # wood grain: long, slightly wavy darker lines
        y = rng.uniform(edge, height)
        colour = rng.choice([(128, 80, 42), (170, 112, 64)])
        points = [(x, y + rng.uniform(-2, 2)) for x in range(0, width + 40, 40)]
        draw.line(points, fill=colour, width=2)
    draw.rectangle((0, edge, width, edge + 6), fill=(110, 68, 36))  # the table's back edge


def wall(canvas: Image.Image, rng: random.Random) -> None:
    width, height = canvas.size
    draw = ImageDraw.Draw(canvas)
    floor = int(height * 0.8)
    draw.rectangle((0, 0, width, floor), fill=(200, 196, 188))  # mortar
    brick_w, brick_h, gap = 96, 40, 6
    for row, top in enumerate(range(0, floor, brick_h + gap)):
        offset = -(brick_w // 2) * (row % 2)
        for left in range(offset, width, brick_w + gap):
            tone = rng.randint(-18, 18)
            draw.rectangle(
                (left, top, left + brick_w, min(top + brick_h, floor)),
                fill=(168 + tone, 74 + tone // 2, 56 + tone // 2),
            )
    draw.rectangle((0, floor, width, height), fill=(120, 118, 112))  # concrete floor


BACKGROUNDS = {"sky": sky, "grass": grass, "table": table, "wall": wall}


if __name__ == "__main__":
    default = Path(__file__).resolve().parent / "sks_toy"
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else default)

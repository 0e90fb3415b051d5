"""What the evaluation pass writes for people to look at: images, contact sheets (rows are prompts,
columns adapter strengths), text answers side by side, and the loss-against-step plot."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..util import atomic

if TYPE_CHECKING:
    from PIL import Image


def strength_label(s: float) -> str:
    return f"{s:g}"


def write_outputs(folder: Path, grid: list[list[Any]], prompts: list[str], strengths: list[float],
                   title: str, ema: list[bool] | None = None,
                   controls: list[Any] | None = None) -> tuple[list[list[Path]], Path]:
    """One file per image (``p{prompt}_s{strength}``, ``p{prompt}_ema_s{strength}`` for a column of
    train.ema's moving average: ``ema[j]``) and the contact sheet (or answers.md for text). An edit
    model's ``controls`` (each prompt's source image) are saved as ``p{prompt}_source.png`` and shown
    as the sheet's first column."""
    ema = ema or [False] * len(strengths)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in set(folder.glob("p*_s*.*")):  # an earlier evaluation's (p*_source.png too), maybe other prompts
        stale.unlink(missing_ok=True)
    paths: list[list[Path]] = []
    if isinstance(grid[0][0], str):  # a text family: answers instead of images
        for i, row in enumerate(grid):
            paths.append([])
            for s, answer in zip(strengths, row):
                path = folder / f"p{i}_s{strength_label(s)}.txt"
                atomic.write_text(path, answer)
                paths[-1].append(path)
        sheet = folder / "answers.md"
        lines = [f"# {title}", ""]
        for prompt, row in zip(prompts, grid):
            lines += [f"## {prompt}", ""] + [f"**{'base model' if s == 0 else f'adapter, strength {strength_label(s)}'}**"
                                             f"\n\n{a}\n" for s, a in zip(strengths, row)]
        atomic.write_text(sheet, "\n".join(lines))
        return paths, sheet
    for i, row in enumerate(grid):
        paths.append([])
        for s, e, image in zip(strengths, ema, row):
            path = folder / f"p{i}{'_ema' if e else ''}_s{strength_label(s)}.png"
            with atomic.atomic_path(path, suffix=".png") as tmp:
                image.save(tmp, format="PNG")
            paths[-1].append(path)
    for i, control in enumerate(controls or ()):
        with atomic.atomic_path(folder / f"p{i}_source.png", suffix=".png") as tmp:
            control.save(tmp, format="PNG")
    sheet = folder / "contact_sheet.png"
    with atomic.atomic_path(sheet, suffix=".png") as tmp:
        contact_sheet(grid, prompts, strengths, title, ema, controls).save(tmp, format="PNG")
    return paths, sheet


def contact_sheet(grid: list[list["Image.Image"]], prompts: list[str], strengths: list[float],
                  title: str = "", ema: list[bool] | None = None,
                  controls: list["Image.Image"] | None = None) -> "Image.Image":
    """Rows are prompts (labelled with the prompt text), columns adapter strengths (0 = the base
    model), of the trained weights or (``ema[j]``) of their moving average; an edit model's source
    images (``controls``, one per prompt) first."""
    ema = ema or [False] * len(strengths)
    from PIL import Image, ImageDraw

    labels = ["strength 0 (base)" if s == 0 else f"{'EMA ' if e else ''}strength {strength_label(s)}"
              for s, e in zip(strengths, ema)]
    if controls:
        grid, labels = [[c, *row] for c, row in zip(controls, grid)], ["source image", *labels]

    side = max(im.width for row in grid for im in row)
    cell = max(192, min(512, side))  # tiny images are enlarged (pixelated) so labels fit, huge ones shrunk
    fs = max(12, cell // 14)
    font = _font(fs)
    pad = max(4, fs // 2)
    label_w = cell
    head_h = pad + 2 * (fs + pad)
    width = label_w + len(labels) * (cell + pad) + pad
    height = head_h + len(prompts) * (cell + pad) + pad
    sheet = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((pad, pad), title, fill="black", font=font)
    for j, label in enumerate(labels):
        draw.text((label_w + j * (cell + pad), pad + fs + pad), label, fill="black", font=font)
    max_lines = max(1, cell // (fs + 3))
    for i, prompt in enumerate(prompts):
        y = head_h + i * (cell + pad)
        lines = _wrap(draw, prompt, font, label_w - 2 * pad, max_lines)
        draw.multiline_text((pad, y), "\n".join(lines), fill="black", font=font, spacing=3)
        for j, image in enumerate(grid[i]):
            image = image.convert("RGB")
            resample = Image.NEAREST if image.width <= cell else Image.LANCZOS
            fitted = image.resize((cell, max(1, round(image.height * cell / image.width))), resample)
            sheet.paste(fitted, (label_w + j * (cell + pad), y))
    return sheet


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the small bitmap font only
        return ImageFont.load_default()


def _wrap(draw: Any, text: str, font: Any, width: int, max_lines: int) -> list[str]:
    lines: list[str] = []
    for word in text.split():
        if lines and draw.textlength(f"{lines[-1]} {word}", font=font) <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1].rstrip(" ,.") + "..."
    return lines


def plot_losses(rows: list[dict[str, Any]], base: dict[str, Any], best: int | None, path: Path, title: str,
                draws: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if any(r["heldout"] is not None for r in rows):
        ax.plot(steps, [r["heldout"] for r in rows], "o-", lw=2, color="C1", label="held-out loss")
        if base.get("heldout") is not None:
            ax.axhline(base["heldout"], ls=":", color="C1", alpha=0.7, label="held-out, base model")
    ax.plot(steps, [r["train"] for r in rows], "s--", lw=1.5, color="C0", label="training-image loss")
    if base.get("train") is not None:
        ax.axhline(base["train"], ls=":", color="C0", alpha=0.7, label="training images, base model")
    if best is not None:
        value = next(r["heldout"] for r in rows if r["step"] == best)
        ax.plot([best], [value], "*", ms=16, color="C3", label=f"best: update {best}")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer update (checkpoint)")
    ax.set_ylabel(f"loss (fixed noise, mean of {draws} draws)")
    ax.set_title(f"{title}: loss against step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic.atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)

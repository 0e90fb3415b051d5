"""``imglora eval RUN_DIR``: the separate evaluation pass (see :mod:`imglora.commands.evaluate`).

cli.py registers it as ``imglora eval``.
"""

from __future__ import annotations

import click


def _strengths(ctx: click.Context, param: click.Parameter, value: str | None) -> list[float] | None:
    if value is None:
        return None
    try:
        out = [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected numbers separated by commas, e.g. 0,0.5,1") from None
    if not out:
        raise click.BadParameter("give at least one strength, e.g. 0,0.5,1")
    return out


def _checkpoint(ctx: click.Context, param: click.Parameter, value: str) -> str | int:
    if value in ("latest", "final"):
        return value
    if value.isdigit():
        return int(value)
    raise click.BadParameter(f"{value!r}: expected an update number, latest or final")


@click.command("eval", short_help="Evaluate a run: contact sheets, held-out loss, best checkpoint.")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--checkpoint", "which", default="latest", show_default=True, metavar="STEP|latest|final",
              callback=_checkpoint, help="Which adapter: a checkpoint's update number, the newest one, or "
                                         "the run's final adapter/.")
@click.option("--all-checkpoints", is_flag=True, help="Evaluate every kept checkpoint, plot held-out and "
                                                      "training loss against step, name the best.")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False),
              help="Text file with one prompt per line (# starts a comment); default eval.prompts, else "
                   "training captions with and without the trigger word.")
@click.option("--strengths", callback=_strengths, metavar="S,S,...",
              help="Adapter strengths, the contact sheet's columns; default eval.strengths (0,0.5,1). "
                   "0 is the base model.")
@click.option("--seed", type=int, help="Seed of the images; default eval.seed.")
@click.option("--weights", type=click.Choice(["auto", "raw", "ema", "both"]), default="auto", show_default=True,
              help="raw: the trained weights; ema: train.ema's moving average; both: columns for each; auto: both "
                   "when the run kept a moving average, else raw.")
@click.option("--set", "overrides", multiple=True, metavar="eval.KEY=VALUE",
              help="Override an eval.* key, e.g. --set eval.blocks_to_swap=0 --set eval.sample_steps=28.")
def eval_cmd(run_dir: str, which: str | int, all_checkpoints: bool, prompts_file: str | None,
             strengths: list[float] | None, seed: int | None, weights: str, overrides: tuple[str, ...]) -> None:
    """Evaluate a trained run in a fresh process: images per prompt and adapter strength with a
    contact sheet, held-out and training-image loss, and an eval record with its peak memory."""
    from .commands.evaluate import evaluate
    from .progress import stamped

    evaluate(run_dir, checkpoint=which, all_checkpoints=all_checkpoints, prompts_file=prompts_file,
             strengths=strengths, seed=seed, overrides=overrides, weights=weights, out=stamped(click.echo))

"""``imglora merge``; registered on the main group with ``main.add_command(merge_cmd, "merge")``."""

from __future__ import annotations

import click


@click.command("merge", short_help="Merge an adapter into its full-precision base and save a model folder.")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--out", required=True, type=click.Path(), help="Folder for the merged model (a normal transformers folder).")
@click.option("--checkpoint", "which", default=None, metavar="STEP|latest",
              help="Merge a checkpoint's adapter instead of the run's final one.")
@click.option("--dtype", type=click.Choice(["auto", "bf16", "fp16", "fp32"]), default="auto", show_default=True,
              help="Precision of the merged weights; auto = the base model's own.")
@click.option("--force", is_flag=True, help="Replace --out if it exists and is not empty.")
def merge_cmd(run_dir: str, out: str, which: str | None, dtype: str, force: bool) -> None:
    """Merge a run's LoRA adapter into the full-precision base model (merge_and_unload) and save the
    result, with the tokenizer, as a model folder that transformers and vLLM load directly (for the
    families that support it: chat LLMs)."""
    from .commands.merge import merge

    merge(run_dir, out, which=which, dtype=dtype, force=force, log=click.echo)

"""The ``imglora`` command line. Each command parses, loads the config, and calls one function."""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
from pathlib import Path

import click

from .util.version import __version__
from .errors import ImgloraError

SET_HELP = "Override a preset key, e.g. --set train.max_steps=100 (repeatable)."


class _Group(click.Group):
    """Turns user errors into a clear message and an exit code, never a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ImgloraError as exc:
            if not exc.exit_code:  # nothing to do, which is not a failure (resume.RunComplete)
                click.echo(str(exc))
                sys.exit(0)
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:  # Ctrl-C where nothing needs saving: exit as a shell reports SIGINT
            click.echo("interrupted (Ctrl-C)", err=True)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100,
                                           "terminal_width": 100})
@click.version_option(__version__, prog_name="imglora")
@click.option("-v", "--verbose", is_flag=True, help="Show debug logging.")
def main(verbose: bool) -> None:
    """LoRA training for SDXL and FLUX.1-dev on rented GPUs: least memory and time, cost known
    before you pay, adapters ready for ComfyUI."""
    # Library chatter (per-file progress bars, optional-dependency notices) would drown imglora's
    # own progress; set before those libraries are imported, and only where the user has not.
    if not verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from .runs.progress import is_tty

    # Logs written to a file or pipe get the time of each line, as imglora's own lines do.
    fmt = "%(levelname)s %(name)s: %(message)s" if is_tty(sys.stderr) else "[%(asctime)s] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=fmt, datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "filelock", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _load(preset: str, overrides: tuple[str, ...]):
    from .commands.common import load_config

    cfg = load_config(preset, overrides)
    for note in cfg.notes:
        click.echo(f"note: {note}", err=True)
    return cfg


@main.command("config", short_help="Check a preset and print the resolved config as TOML.")
@click.argument("preset", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--keys", is_flag=True, help="List every key with its default and meaning instead.")
def config_cmd(preset: str, overrides: tuple[str, ...], keys: bool) -> None:
    """Check a preset and print the resolved configuration as TOML."""
    if keys:
        from . import config
        from .families import registry

        for key, default, help_ in config.field_help(registry):
            click.echo(f"{key} = {default}\n    {help_}")
        return
    from .training.resume import check_dependencies

    cfg = _load(preset, overrides)
    try:  # what `train` checks next, before any model: packages (and CUDA) this machine lacks
        check_dependencies(cfg)
    except ImgloraError as exc:  # a note, not an error: the preset may be meant for another machine
        click.echo(f"note: on this machine {exc}; `imglora train` refuses it here", err=True)
    click.echo(cfg.to_toml(), nl=False)


@main.command("cache-latents", short_help="Encode latents and text embeddings once into the cache.")
@click.argument("preset", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--verify", is_flag=True, help="Re-check every cache entry and report stale, missing or corrupt ones.")
def cache_latents_cmd(preset: str, overrides: tuple[str, ...], verify: bool) -> None:
    """Encode VAE latents and text-encoder outputs once, into the content-keyed cache."""
    from .commands.cache import cache_latents

    code = cache_latents(_load(preset, overrides), verify=verify, out=click.echo,
                         warn=lambda s: click.echo(s, err=True))
    if code:
        sys.exit(code)


@main.command("train", short_help="Train a LoRA: cache, train, checkpoint, adapter, record.")
@click.argument("preset", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint of the run folder.")
@click.option("--gpus", type=click.IntRange(min=1), default=None,
              help="Train data-parallel on this many GPUs of this machine (one process each, as `accelerate "
                   "launch` starts them; without CUDA, that many CPU processes). Same as launching `-m imglora "
                   "train` with accelerate yourself.")
def train_cmd(preset: str, overrides: tuple[str, ...], resume: bool, gpus: int | None) -> None:
    """Train a LoRA adapter: cache, train, checkpoint, write the adapter and run record."""
    import shlex

    from .util import distributed
    from .commands.train import train
    from .runs.progress import stamped

    cfg = _load(preset, overrides)  # checked once here, before any process starts
    if gpus and gpus > 1 and distributed.launched_processes() == 1:
        argv = ["train", preset, *[x for o in overrides for x in ("--set", o)], *(["--resume"] if resume else [])]
        click.echo(f"starting {gpus} processes: {distributed.describe([sys.executable, '-m', 'imglora', *argv])}")
        sys.exit(distributed.launch(gpus, argv))
    command = shlex.join(["imglora", "train", preset, *[x for o in overrides for x in ("--set", o)]])
    if distributed.launched_processes() > 1:  # how to start it again: with as many processes
        command += f" --gpus {distributed.launched_processes()}"
    result = train(cfg, resume=resume, command=command, out=stamped(click.echo))
    # Interrupted runs exit as a shell reports a process killed by that signal (128 + number), so a
    # scheduler sees "interrupted, resumable" rather than success; the checkpoint is written first.
    if result.interrupted and result.signal in ("SIGINT", "SIGTERM"):
        sys.exit(128 + int(getattr(signal, result.signal)))
    if result.signal == "budget":
        sys.exit(3)  # stopped by the budget guard: the work is saved, but the run is not finished


@main.command("export", short_help="Write a ComfyUI-ready .safetensors and ComfyUI workflows.")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--checkpoint", default="latest", show_default=True,
              help="latest, final, or a checkpoint's update number.")
@click.option("--comfyui", "comfyui", type=click.Path(file_okay=False), default=None,
              help="ComfyUI folder: writes models/loras/<name>.safetensors (honours extra_model_paths.yaml).")
@click.option("--out", type=click.Path(), default=None, help="Write to this file (or folder) instead.")
@click.option("--name", default=None, help="File name without extension; default: the run's name.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="Precision of the exported tensors; default: the preset's export.dtype (bf16).")
@click.option("--format", "fmt", default=None, metavar="FORM",
              help="Key layout: default (the family's ComfyUI-ready form) or another form the family offers, "
                   "e.g. kohya; default: the preset's export.format.")
@click.option("--weights", type=click.Choice(["auto", "ema", "raw"]), default="auto", show_default=True,
              help="ema: train.ema's moving average; raw: the trained weights; auto: ema when the run kept one.")
@click.option("--force", is_flag=True, help="Replace an existing file.")
def export_cmd(run_dir: str, checkpoint: str, comfyui: str | None, out: str | None, name: str | None,
               dtype: str | None, fmt: str | None, weights: str, force: bool) -> None:
    """Write a ComfyUI-ready .safetensors (and two ComfyUI workflows) from a run."""
    from .commands.export import export

    r = export(Path(run_dir), checkpoint=checkpoint, comfyui=Path(comfyui) if comfyui else None,
               out=Path(out) if out else None, name=name, dtype=dtype, fmt=fmt, force=force, weights=weights)
    for warning in r.warnings:
        click.echo(f"warning: {warning}", err=True)
    click.echo(f"exported {r.n_tensors} tensors ({r.format} form, {r.source}) to {r.path}")
    click.echo(f"ComfyUI workflow: {r.workflow_ui} (drag onto the ComfyUI window); API form: {r.workflow_api}")


class _Size(click.ParamType):
    """A memory size such as 24GB, read as ``bench.parse_size`` reads it: zero, a negative or an
    unreadable size exits 2 naming the option and the value, before the preset is read."""

    name = "size"

    def convert(self, value, param, ctx):
        from .commands.bench import parse_size

        option = param.opts[0] if param is not None else "size"
        try:
            parse_size(value, option)
        except ImgloraError as exc:
            self.fail(str(exc).removeprefix(f"{option} "), param, ctx)
        return value


SIZE = _Size()


@main.command("bench-swap", short_help="Measure s/update and peak memory per block-swap setting.")
@click.argument("preset", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--blocks", default="0,9,18,27", show_default=True,
              help="Swap settings (kohya count), e.g. 0,9,18 or fp8:18,bf16:0 to compare precisions too.")
@click.option("--fp8/--no-fp8", "fp8", default=None, help="FP8 base for bare numbers in --blocks (default: the preset's).")
@click.option("--steps", default=12, show_default=True, type=click.IntRange(min=1),
              help="Measured optimizer updates per setting.")
@click.option("--warmup", default=3, show_default=True, type=click.IntRange(min=0), help="Updates before measuring.")
@click.option("--resolution", type=click.IntRange(min=16), help="Square training resolution (default: the preset's).")
@click.option("--vram-budget", type=SIZE, help="Name the fastest setting whose peak reserved memory fits, e.g. 24GB.")
@click.option("--arch", type=click.Choice(["preset", "full"]), default="preset", show_default=True,
              help="full: the family's full-size architecture with random weights (no download).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Folder for bench.json/csv/png.")
@click.option("--timeout", default=3600, show_default=True, type=click.IntRange(min=1),
              help="Seconds allowed per setting.")
@click.option("--gpus", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run each setting data-parallel on this many processes (GPUs): seconds per update at N vs 1.")
@click.option("--detect-anomaly", is_flag=True, help="Find where NaN or infinite values first appear: every "
              "backward under torch.autograd.detect_anomaly (slow; a setting stops at the first such value, "
              "naming the operation and, in its worker.log, the forward line that made it).")
def bench_swap_cmd(preset, overrides, blocks, fp8, steps, warmup, resolution, vram_budget, arch, out_dir, timeout,
                   gpus, detect_anomaly):
    """Measure seconds per update and peak memory for several swap settings; name the fastest that fits."""
    from .commands import bench
    from .runs.progress import stamped

    cfg = _load(preset, overrides)
    settings = bench.parse_settings(blocks, cfg.memory.fp8 if fp8 is None else fp8)
    bench.bench_swap(preset, overrides, settings, steps=steps, warmup=warmup, resolution=resolution,
                     vram_budget=bench.parse_size(vram_budget), arch=arch, out_dir=Path(out_dir) if out_dir else None,
                     timeout=timeout, out=stamped(click.echo), gpus=gpus, detect_anomaly=detect_anomaly)


@main.command("plan", short_help="Predict peak GPU memory, host RAM and seconds per update per setting.")
@click.argument("preset", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--blocks", help="Settings to plan, as bench-swap takes them (e.g. fp8:0,fp8:18,bf16:0); default: the "
                               "preset's own, fp8 with 0/9/18/27 swapped blocks, and the model dtype unswapped.")
@click.option("--resolution", type=click.IntRange(min=16), help="Square training resolution (default: the preset's).")
@click.option("--gpu", help="The card to predict seconds per update for, and to fit in (unless --vram): h200, h100, "
                            "h100-pcie, a100, l40s, 3090, 4090, 5090. Default: h200.")
@click.option("--vram", type=SIZE, help="GPU memory to fit in, e.g. 24GB: names the fastest setting that fits.")
@click.option("--host-ram", type=SIZE, help="Host RAM to fit in, e.g. 32GB.")
@click.option("--bench", "bench_file", type=click.Path(dir_okay=False),
              help="A bench-swap result (bench.json): its measured seconds per update replace the predicted ones.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="The machine the run is for: cuda (bf16 autocast) or cpu (fp32).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the plan as JSON here.")
@click.option("--gpus", type=click.IntRange(min=1), default=1, show_default=True,
              help="Data-parallel processes: device memory is per GPU; host RAM counts every process's pinned blocks.")
def plan_cmd(preset, overrides, blocks, resolution, gpu, vram, host_ram, bench_file, device, json_out, gpus):
    """Predict, before anything is loaded, the peak GPU memory, host RAM and seconds per update of
    training PRESET for each swap count and precision, term by term, from the architecture built on
    the meta device (seconds: its kernels priced on the card's datasheet peaks, or on this CPU as
    measured with --device cpu)."""
    from .commands import plan

    plan.run(preset, overrides, blocks=blocks, resolution=resolution, vram=vram, host_ram=host_ram,
             bench_file=bench_file, device=device, json_out=json_out, out=click.echo, gpus=gpus, gpu=gpu)


class _Number(click.ParamType):
    """A finite number within bounds; NaN, infinity and out-of-range values exit 2 naming the option."""

    name = "number"

    def __init__(self, minimum: float = 0.0, open_min: bool = False, integer: bool = False):
        self.minimum, self.open_min, self.integer = minimum, open_min, integer
        self.name = "integer" if integer else "number"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = value
        else:
            try:
                number = int(value) if self.integer else float(value)
            except ValueError:
                self.fail(f"{value!r} is not {'an integer' if self.integer else 'a number'}", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if number < self.minimum or (self.open_min and number == self.minimum):
            bound = "greater than" if self.open_min else "at least"
            self.fail(f"{value} must be {bound} {self.minimum:g}", param, ctx)
        return number


POSITIVE = _Number(0.0, open_min=True)
NON_NEGATIVE = _Number(0.0)
COUNT = _Number(1, integer=True)
NON_NEGATIVE_INT = _Number(0, integer=True)


@main.command("estimate", short_help="Session time and cost from measured phases and offers.")
@click.argument("run_dir", type=click.Path(file_okay=False), required=False)
@click.option("--bench", "bench_file", type=click.Path(dir_okay=False), help="Use a bench-swap result (bench.json).")
@click.option("--setting", help="With --bench: the setting to use (default: the fastest that ran).")
@click.option("--steps", type=COUNT, help="Optimizer updates to plan for (default: the run's).")
@click.option("--epochs", type=POSITIVE, help="Plan for epochs instead: steps = epochs × dataset size ÷ (batch × accum).")
@click.option("--dataset-size", type=COUNT, help="Images (with repeats) per epoch, for --epochs.")
@click.option("--batch-size", type=COUNT, help="Micro-batch size (default: the run's).")
@click.option("--accum", type=COUNT, help="Gradient accumulation (default: the run's).")
@click.option("--sec-per-update", type=POSITIVE, help="Measured seconds per optimizer update.")
@click.option("--sec-per-micro-batch", type=POSITIVE, help="Measured seconds per micro-batch (× accumulation).")
@click.option("--its", type=POSITIVE, help="it/s read from a training log's progress bar.")
@click.option("--its-unit", type=click.Choice(["micro", "update"]), help="What that progress bar counted.")
@click.option("--setup", type=NON_NEGATIVE, help="Seconds of set-up (model load); default: measured.")
@click.option("--cache", "cache_s", type=NON_NEGATIVE, help="Seconds of caching; default: measured (0 with a full cache).")
@click.option("--checkpoint-every", type=NON_NEGATIVE_INT, help="Updates between checkpoints (default: the run's).")
@click.option("--sec-per-checkpoint", type=NON_NEGATIVE, help="Seconds per checkpoint save; default: measured.")
@click.option("--eval-seconds", type=NON_NEGATIVE, help="Seconds of evaluation; default: measured.")
@click.option("--idle-minutes", type=NON_NEGATIVE, default=0.0, show_default=True,
              help="Minutes the meter runs besides the work (boot, upload, download).")
@click.option("--rate", type=NON_NEGATIVE, help="Hourly price of the machine.")
@click.option("--currency", default="USD", show_default=True)
@click.option("--storage", help="GB:PRICE_PER_GB_MONTH of disk billed while the session runs.")
@click.option("--transfer", help="GB:PRICE_PER_GB of data transfer.")
@click.option("--offer", "offers", multiple=True, metavar="NAME:RATE[:SEC_PER_UPDATE]",
              help="Compare machines: hourly rate and, when measured there, seconds per update (repeatable). "
                   "Without SEC_PER_UPDATE the offer assumes the speed this estimate uses, measured on the device "
                   "it names; that is refused when it was measured on a CPU.")
@click.option("--gpus", type=click.IntRange(min=1), help="Data-parallel processes (GPUs) to count GPU-hours for "
                                                         "(default: the run's).")
def estimate_cmd(run_dir, bench_file, setting, steps, epochs, dataset_size, batch_size, accum, sec_per_update,
                 sec_per_micro_batch, its, its_unit, setup, cache_s, checkpoint_every, sec_per_checkpoint,
                 eval_seconds, idle_minutes, rate, currency, storage, transfer, offers, gpus) -> None:
    """Session time and cost from measured phases: where the time goes, and what it costs per offer."""
    from .commands.estimate import estimate

    estimate(run_dir, bench_file, setting, steps, epochs, dataset_size, batch_size, accum, sec_per_update,
             sec_per_micro_batch, its, its_unit, setup, cache_s, checkpoint_every, sec_per_checkpoint, eval_seconds,
             idle_minutes, rate, currency, storage, transfer, offers, gpus=gpus)


@main.command("doctor", short_help="Check this machine for a preset: GPU, memory, disk, pinned memory, PCIe, model.")
@click.argument("preset", required=False)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a preset key (repeatable).")
def doctor_cmd(preset: str | None, overrides: tuple[str, ...]) -> None:
    """Before the first update on a new machine: the GPU(s), driver and CUDA versions, torch's CUDA
    build, free GPU memory and host RAM against the plan for PRESET's own setting, free disk where the
    run and the cache write, the page-locked memory limit and a test registration, the PCIe link and a
    one-second host-to-GPU copy probe, whether the model is on disk, and what to change. Exit status 1
    when PRESET cannot run here as it is. Without a CUDA GPU it says so and checks the rest."""
    from .commands.doctor import run

    if not run(preset, overrides).ok:
        raise SystemExit(1)


@main.command("fetch", short_help="Download exactly the model files a preset will read (size shown first).")
@click.argument("preset")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a preset key (repeatable).")
@click.option("--dry-run", is_flag=True, help="List the files and their total size; download nothing.")
def fetch_cmd(preset: str, overrides: tuple[str, ...], dry_run: bool) -> None:
    """Download the files PRESET's run will read, before renting time on them: for a hub id, the
    components in its model_index.json (configs, tokenizers and .safetensors weights, no variants and
    no root single files) or a transformers model's root files; for bare single-file names with
    model.comfyui, each known file into its ComfyUI folder. The list and total size come first; files
    already in the cache are kept; an interrupted download resumes; every file's size and sha256 are
    checked against the hub's listing. A gated model gets its licence page and `hf auth login`.
    `imglora train` itself never downloads."""
    from .commands.fetch import fetch

    fetch(preset, overrides, dry_run=dry_run, out=click.echo)



def _extension_option(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from .config.checks import extension_problem

    why = extension_problem(value)
    if why:
        raise click.BadParameter(why)
    return value


@main.command("caption", short_help="Write .txt captions for the images of a folder that have none.")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--model", default=None, help="A vision-language model (hub id or folder) with a chat template "
              "[default: HuggingFaceTB/SmolVLM-256M-Instruct, small enough for a laptop CPU].")
@click.option("--trigger", default="", help="Put this word first in every caption written.")
@click.option("--style", type=click.Choice(["natural", "tags"]), default="natural", show_default=True,
              help="natural: one or two sentences (models with T5 or language-model text encoders); tags: comma-separated "
              "tags (tag-trained finetunes).")
@click.option("--overwrite", is_flag=True, help="Caption every image, replacing existing captions.")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--prompt", default="", help="Ask the model this instead of the style's instruction.")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=0, help="0 = the style's (96 natural, 64 tags).")
@click.option("--caption-ext", default=".txt", show_default=True, callback=_extension_option)
@click.option("--resolution", type=click.IntRange(min=64), default=1024, show_default=True,
              help="Training resolution the scan's crop and upscale warnings are judged at.")
@click.option("--device", default="auto", show_default=True, help="auto (CUDA if present), cpu or cuda.")
def caption_cmd(folder, model, trigger, style, overwrite, batch_size, prompt, max_new_tokens, caption_ext, resolution,
                device) -> None:
    """Caption the images in FOLDER (and its <repeats>_<name> subfolders) that have no caption: one .txt
    each, from a vision-language model through transformers, in batches, with progress; existing captions
    are kept unless --overwrite. Afterwards the dataset scan's warnings for the folder are printed."""
    from .commands.caption import DEFAULT_MODEL, caption_folder

    caption_folder(folder, model=model or DEFAULT_MODEL, trigger=trigger, style=style, overwrite=overwrite,
                   batch_size=batch_size, prompt=prompt, max_new_tokens=max_new_tokens, caption_ext=caption_ext,
                   resolution=resolution, device=device, out=click.echo)


@main.command("ui", short_help="A web page to prepare, launch, watch, stop, evaluate and export runs.")
@click.option("--root", default=".", show_default=True, type=click.Path(file_okay=False),
              help="The folder whose run folders (DIR/<run> and DIR/runs/<run>) and datasets the page shows.")
@click.option("--presets", default=None, type=click.Path(file_okay=False),
              help="Folder of presets the New run page offers [default: ROOT/presets].")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="The address to bind. Anything but localhost is reachable from other machines (the token "
              "guards it; --no-token is refused there).")
@click.option("--port", default=7860, show_default=True, type=click.IntRange(1, 65535))
@click.option("--token", default=None, help="The token every request must carry [default: a new random one, "
              "printed in the URL to open]. The URL swaps it for an HTTP-only cookie; scripts send "
              "Authorization: Bearer TOKEN.")
@click.option("--no-token", is_flag=True, help="No token, on localhost only. Risk: any program or user on this "
              "machine (another account, a container, a page a browser opens on another port) can then reach "
              "the UI and start or stop runs and rewrite captions through it.")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="Also answer requests whose Host is NAME (repeatable): the name of an SSH tunnel or a proxy "
              "in front of the UI. Other names get 403 (a guard against DNS rebinding).")
def ui_cmd(root: str, presets: str | None, host: str, port: int, token: str | None, no_token: bool,
           allow_hosts: tuple[str, ...]) -> None:
    """Serve the web UI over the run folders under ROOT: runs with their live loss curve, state, cost and
    Stop/Resume; a new run from a preset with every key's meaning, checked as `imglora config` checks it,
    planned, and started as `imglora train`; the dataset's images with editable captions and the scan's
    warnings; evaluation and export; doctor and fetch. Binds 127.0.0.1 and asks a token (printed once,
    in the URL to open) unless told otherwise; over SSH: ssh -L 7860:127.0.0.1:7860 BOX, then open the
    printed URL here."""
    try:
        from .ui.server import serve
    except ImportError as exc:  # fastapi or uvicorn missing
        raise ImgloraError(f"the UI needs FastAPI and uvicorn ({exc}): pip install 'imglora[ui]'") from None
    serve(root, host=host, port=port, token=token, presets=presets or str(Path(root) / "presets"),
          no_token=no_token, allow_hosts=allow_hosts, out=click.echo)


# -- eval and merge ------------------------------------------------------------------------------


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


@main.command("eval", short_help="Evaluate a run: contact sheets, held-out loss, best checkpoint.")
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
    from .runs.progress import stamped

    evaluate(run_dir, checkpoint=which, all_checkpoints=all_checkpoints, prompts_file=prompts_file,
             strengths=strengths, seed=seed, overrides=overrides, weights=weights, out=stamped(click.echo))


@main.command("merge", short_help="Merge an adapter into its full-precision base and save a model folder.")
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


if __name__ == "__main__":  # pragma: no cover
    main()

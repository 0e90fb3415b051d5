"""``imglora bench-swap``: measure seconds per update and peak memory for several swap settings.

Each setting runs in a fresh subprocess (``python -m imglora.commands.bench SPEC OUT``), so one setting's
allocator state and peak figures never leak into the next, and an out-of-memory failure ends only
that setting. The worker builds the model exactly as ``imglora train`` does (LoRA, then FP8, then
block swap, ``loop.build_session``), feeds it the preset's cached data — or synthetic latents and
embeddings of the right shapes when the cache is incomplete — and times whole optimizer updates
(``loop.step``, the trainer's own step, gradient accumulation included) after warm-up, with a device
synchronisation around each so the time is the real one.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..util import atomic
from ..errors import ImgloraError
from ..runs.bench_trace import TRACE, error_lines, last_trace, trace  # noqa: F401 (re-exported)
from ..plan.agreement import (COMPILED, FP8_COMPUTE_RTOL, FP8_SETTINGS, LOSS_RTOL,  # noqa: F401 (re-exported)
                              loss_agreement)

if TYPE_CHECKING:
    from ..models.source import ModelSource


class OptionError(ImgloraError):
    """A command-line value the command cannot use: a usage error, exit 2 as click's own."""

    exit_code = 2


@dataclass(frozen=True)
class Setting:
    precision: str  # "fp8" or the model dtype ("bf16", "fp16", "fp32")
    blocks: int     # kohya-style blocks_to_swap
    compiled: bool = False  # memory.compile = "blocks"

    @property
    def name(self) -> str:
        return f"{self.precision}{COMPILED if self.compiled else ''}:{self.blocks}"




def parse_settings(text: str, default_fp8: bool) -> list[Setting]:
    """``"0,9,18"`` or ``"fp8:0,fp8:18,bf16:0"``; a bare number takes --fp8/--no-fp8. ``fp8f``: fp8
    weights dequantized by the fused path (memory.fp8_fused); ``fp8c``: fp8 compute
    (memory.fp8_compute); ``+compile`` after the precision: compiled blocks (memory.compile = "blocks")."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        precision, _, number = item.rpartition(":")
        compiled = precision.endswith(COMPILED)
        precision = precision.removesuffix(COMPILED) or ("fp8" if default_fp8 else "model")
        if precision not in (*FP8_SETTINGS, "model", "bf16", "fp16", "fp32") or not number.isdigit():
            raise OptionError(f"--blocks item {item!r}: expected N or PRECISION:N with PRECISION fp8, fp8f (fp8, "
                               "fused dequantize), fp8c (fp8 compute), bf16, fp16 or fp32, each optionally followed "
                               "by +compile (compiled blocks; e.g. 0,9,18 or fp8:18,fp8f:18,fp8c:18,bf16:0)")
        out.append(Setting(precision, int(number), compiled))
    if not out:
        raise OptionError("--blocks: give at least one setting")
    return out


def parse_size(text: str | None, option: str = "--vram-budget") -> int | None:
    """Bytes of a size such as 24GB (None: not given). Zero or less is refused, not read as "no
    budget" or "nothing fits": leave the option out for no budget."""
    if not text:
        return None
    units = {"tb": 2**40, "gb": 2**30, "gib": 2**30, "mb": 2**20, "mib": 2**20}
    t = text.strip().lower()
    for suffix, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(suffix):
            try:
                number = float(t[: -len(suffix)])
            except ValueError:
                break
            if not math.isfinite(number) or int(number * mult) <= 0:
                raise ImgloraError(f"{option} {text!r}: a size must be a finite number greater than 0, such as 24GB "
                                   "(leave the option out for no limit)")
            return int(number * mult)
    raise ImgloraError(f"{option} {text!r}: expected a size such as 24GB or 80GiB")


# ----------------------------------------------------------------------------------------------
# Parent: one subprocess per setting, then the report


def bench_swap(preset: str, overrides: tuple[str, ...], settings: list[Setting], *, steps: int, warmup: int,
               resolution: int | None, vram_budget: int | None, arch: str, out_dir: Path | None,
               timeout: float = 3600, out: Callable[[str], None] = print, gpus: int = 1,
               detect_anomaly: bool = False) -> dict[str, Any]:
    from ..family import Swappable, supports
    from .common import family_of, load_config

    cfg = load_config(preset, overrides)  # fail fast, before any subprocess
    if any(s.blocks for s in settings) and not supports(family_of(cfg), Swappable):
        raise ImgloraError(f"{preset}: the {cfg.model.family} family has no swappable blocks; use --blocks 0")
    check_counts(cfg, settings, arch)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(out_dir) if out_dir else Path(cfg.run.output_dir) / f"bench-swap-{cfg.run.name}-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for i, s in enumerate(settings, 1):
        out(f"[{i}/{len(settings)}] {s.name}: running in a fresh process ...")
        spec = {"preset": preset, "overrides": list(overrides), "precision": s.precision, "blocks": s.blocks,
                "compile": s.compiled, "setting": s.name,
                "steps": steps, "warmup": warmup, "resolution": resolution, "arch": arch, "processes": gpus,
                "detect_anomaly": detect_anomaly}
        results.append(_run_worker(spec, out_dir / f"setting-{i}", timeout))
        out("    " + _one_line(results[-1]))
    report = {"preset": preset, "overrides": list(overrides), "family": cfg.model.family, "arch": arch,
              "resolution": resolution or cfg.data.max_resolution, "rank": cfg.lora.rank,
              "batch_size": cfg.train.batch_size, "grad_accum": cfg.train.grad_accum, "steps": steps,
              "warmup": warmup, "vram_budget": vram_budget, "processes": gpus, "results": results,
              "environment": results[0].get("environment") if results else None}
    report["best"] = best_setting(results, vram_budget)
    report["loss_agreement"] = loss_agreement(results)
    write_report(report, out_dir)
    out(format_table(report))
    for line in report["loss_agreement"]:
        out(f"losses: {line['text']}")
    out(f"best: {report['best']['text']}")
    out(f"written: {out_dir / 'bench.json'}, bench.csv, bench.png")
    if not any(r.get("status") == "ok" for r in results):
        raise ImgloraError(f"no setting finished; each one's output is in its worker.log under {out_dir}")
    broken = [f"{r['setting']} (from update {r['first_nonfinite_update'] + 1})" for r in results
              if r.get("status") == "ok" and r.get("first_nonfinite_update") is not None]
    if broken:
        raise ImgloraError(f"losses or gradients not finite in {', '.join(broken)}: those settings trained nothing, so their "
                           "timings do not measure training (bench.json: results[].losses)")
    differ = [a["text"] for a in report["loss_agreement"] if not a["agree"]]
    if differ:
        raise ImgloraError("settings of one precision trained different losses, so their timings compare different "
                           f"computations: {'; '.join(differ)} (bench.json: results[].losses)")
    return report


def check_counts(cfg: Any, settings: list[Setting], arch: str) -> None:
    """Refuse, before any process starts, swap counts the model cannot have (each would only fail
    in its worker), naming them and the largest count that works."""
    from ..family import Swappable, supports
    from ..plan.budget import valid_swap
    from .common import family_of

    family = family_of(cfg)
    if not supports(family, Swappable) or not any(s.blocks for s in settings):
        return
    lengths, model = _block_lengths(cfg, family, arch)
    if lengths is None:
        return
    bad = [s.name for s in settings if not valid_swap(family, lengths, cfg, s.blocks)]
    if bad:
        largest = max(n for n in range(2 * sum(lengths) + 2) if valid_swap(family, lengths, cfg, n))
        lists = ", ".join(f"{name}: {n}" for name, n in zip(family.swappable_blocks, lengths))
        raise OptionError(f"--blocks: {', '.join(bad)}: {model} cannot swap that many blocks (its block lists: "
                          f"{lists}; counted as kohya does); the largest valid number is {largest}")


def _block_lengths(cfg: Any, family: Any, arch: str) -> tuple[list[int] | None, str]:
    """Blocks per swappable list of the model the settings will run, from its config alone."""
    if arch == "full":  # the family's full-size architecture, the one full_trainable builds
        return family.full_block_counts(cfg), f"the full-size {family.name} model"
    from ..models.resolve import resolve_model

    return family.block_counts(resolve_model(cfg.model, family)), cfg.model.path


def _run_worker(spec: dict[str, Any], folder: Path, timeout: float) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = folder / "spec.json", folder / "result.json"
    spec_path.write_text(json.dumps(spec))
    base = {"setting": spec.get("setting") or f"{spec['precision']}:{spec['blocks']}", "precision": spec["precision"],
            "blocks": spec["blocks"], "compiled": bool(spec.get("compile"))}
    try:
        args = [str(spec_path), str(result_path)]
        if spec.get("processes", 1) > 1:  # data parallel: every process times the same updates
            from ..util import distributed

            cmd = distributed.launch_command(spec["processes"], args, "imglora.commands.bench")
        else:
            cmd = [sys.executable, "-m", "imglora.commands.bench", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**base, "status": "timeout", "stage": "unknown", "error": f"no result after {timeout:.0f} s"}
    (folder / "worker.log").write_text(proc.stdout + proc.stderr)
    if result_path.exists():
        return {**base, **json.loads(result_path.read_text())}
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    # A process killed by the kernel's OOM killer leaves no result; say so rather than guess.
    status = "killed" if proc.returncode < 0 else "failed"
    return {**base, "status": status, "stage": last_trace(proc.stderr), "returncode": proc.returncode,
            "error": error_lines(lines)}


def best_setting(results: list[dict[str, Any]], vram_budget: int | None) -> dict[str, Any]:
    ok = [r for r in results if r.get("status") == "ok"]
    if not ok:
        return {"setting": None, "text": "no setting finished"}
    fits = ok
    note = ""
    if vram_budget:
        if ok[0].get("device") == "cuda":
            fits = [r for r in ok if (r["peak_reserved"] or 0) <= vram_budget]
            note = f" within the {vram_budget / 2**30:.0f} GiB budget (peak reserved)"
        else:
            note = " (no GPU: the VRAM budget was not applied)"
    if not fits:
        return {"setting": None, "text": f"no setting fits the {vram_budget / 2**30:.0f} GiB budget"}
    best = min(fits, key=lambda r: r["sec_per_update"]["median"])
    return {"setting": best["setting"], "text": f"{best['setting']} at {best['sec_per_update']['median']:.3f} "
                                               f"s/update{note}"}


COLUMNS = ("setting", "status", "s/update median", "p10", "p90", "peak alloc GiB", "peak reserved GiB",
           "peak RSS GiB", "H2D MiB/update", "weights MiB")


def _row(r: dict[str, Any]) -> list[str]:
    def g(n: Any) -> str:
        return "" if n is None else f"{n / 2**30:.2f}"

    if r.get("status") != "ok":
        return [r["setting"], f"{r['status']} ({r.get('stage', '?')})"] + [""] * (len(COLUMNS) - 2)
    t = r["sec_per_update"]
    status = "ok" if r.get("first_nonfinite_update") is None else f"NaN from {r['first_nonfinite_update'] + 1}"
    return [r["setting"], status, f"{t['median']:.3f}", f"{t['p10']:.3f}", f"{t['p90']:.3f}", g(r["peak_allocated"]),
            g(r["peak_reserved"]), g(r["peak_rss"]), f"{r['h2d_bytes_per_update'] / 2**20:.2f}",
            f"{r['weight_bytes'] / 2**20:.1f}"]


def format_table(report: dict[str, Any]) -> str:
    rows = [list(COLUMNS)] + [_row(r) for r in report["results"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    atomic.write_json(out_dir / "bench.json", report)
    with atomic.atomic_path(out_dir / "bench.csv", suffix=".csv") as tmp:
        with open(tmp, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(COLUMNS)
            w.writerows(_row(r) for r in report["results"])
    _plot(report, out_dir / "bench.png")


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    names = [r["setting"] for r in res]
    ok = [r.get("status") == "ok" for r in res]
    spu = [r["sec_per_update"]["median"] if o else 0 for r, o in zip(res, ok)]
    mem_key = "peak_allocated" if res and res[0].get("device") == "cuda" else "peak_rss"
    mem = [(r.get(mem_key) or 0) / 2**30 if o else 0 for r, o in zip(res, ok)]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    colors = ["tab:blue" if o else "tab:red" for o in ok]
    a.bar(names, spu, color=colors)
    a.set_ylabel("seconds per optimizer update (median)")
    b.bar(names, mem, color=colors)
    b.set_ylabel("peak allocated GiB" if mem_key == "peak_allocated" else "peak host RSS GiB (no GPU)")
    if report.get("vram_budget") and mem_key == "peak_allocated":
        b.axhline(report["vram_budget"] / 2**30, color="k", ls="--", label="VRAM budget")
        b.legend()
    for ax in (a, b):
        ax.set_xlabel("precision:blocks swapped")
        ax.tick_params(axis="x", rotation=30)
        ax.grid(axis="y", alpha=0.3)
    for name, o in zip(names, ok):
        if not o:
            a.annotate("failed", (name, 0), ha="center", va="bottom", color="tab:red")
    fig.suptitle(f"bench-swap {Path(report['preset']).name} ({report['arch']} arch, {report['resolution']} px, "
                 f"rank {report['rank']})")
    fig.tight_layout()
    with atomic.atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def _one_line(r: dict[str, Any]) -> str:
    if r.get("status") != "ok":
        return f"{r['status']} at stage {r.get('stage', '?')}: {r.get('error', '')[:200]}"
    mem = (f"peak {r['peak_allocated'] / 2**30:.2f} GiB allocated" if r.get("peak_allocated") is not None
           else f"peak RSS {r['peak_rss'] / 2**30:.2f} GiB")
    compiled = f", first update {r['first_update_seconds']:.1f} s (compiling)" if r.get("compile_seconds") else ""
    bad = r.get("first_nonfinite_update")
    nan = f"; LOSS NOT FINITE from update {bad + 1} (nothing trained from there)" if bad is not None else ""
    if r.get("skipped_updates"):
        nan += (f"; {len(r['skipped_updates'])} updates skipped for a non-finite gradient (the first in "
                f"{r.get('first_nonfinite_gradient')})")
    return f"{r['sec_per_update']['median']:.3f} s/update, {mem}{compiled}{nan}"


# ----------------------------------------------------------------------------------------------
# Worker: one setting, in its own process


def run_setting(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from ..util import devices
    from ..training import step as loop
    from ..runs import record, telemetry
    from ..memory.fp8 import weight_bytes
    from ..memory.wrap import preset_swap, resolve_swap
    from ..models.resolve import resolve_model
    from ..family import Swappable, supports
    from .common import family_of, load_config

    device = devices.default_device()
    overrides = list(spec["overrides"])
    if spec["precision"] in FP8_SETTINGS:
        overrides += ["memory.fp8=true"] + [f"memory.{k}={str(v).lower()}" for k, v in
                                            FP8_SETTINGS[spec["precision"]].items()]
    else:
        overrides += ["memory.fp8=false", "memory.fp8_compute=false", "memory.fp8_fused=false"]
        if spec["precision"] != "model":
            overrides.append(f"model.dtype=\"{spec['precision']}\"")
    if spec.get("resolution"):
        overrides.append(f"data.resolution={spec['resolution']}")
    if spec.get("compile"):
        overrides.append('memory.compile="blocks"')
    cfg = load_config(spec["preset"], overrides)
    family = family_of(cfg)
    # The setting's swap count, as kohya counts it (the preset's own per-list counts do not apply).
    if supports(family, Swappable):
        cfg = family.with_blocks_to_swap(cfg, spec["blocks"])
    elif spec["blocks"]:
        raise ImgloraError(f"the {family.name} family has no swappable blocks; bench it with 0 blocks")
    dtype = devices.weight_dtype(cfg, device)
    result: dict[str, Any] = {"device": device.type, "environment": record.environment()}
    stage = "load"
    trace(stage)
    t0 = time.perf_counter()
    try:
        loop.check_attention(cfg, device)  # before the model is made
        accelerator = loop.accelerator_for(cfg)
        if spec["arch"] == "full":
            # On CUDA made there block by block (quantized, swapped blocks sent to the host) rather
            # than whole on the host: minutes per setting less for FLUX.1's 12B.
            swap = preset_swap(family, cfg, None)
            trainable = family.full_trainable(cfg, dtype, swap, device)
            data_source = "synthetic"
            if "full_build" in trainable.facts:
                result["full_build"] = trainable.facts["full_build"]
        else:
            src = resolve_model(cfg.model, family)
            swap = resolve_swap(family, cfg, src)
            trainable = family.load_trainable(src, cfg, device, dtype, swap)
        stage = "memory setup"
        trace(stage)
        session = loop.build_session(cfg, family, trainable, accelerator, swap=swap, total=None, out=lambda s: None)
        memory = session.memory
        result["weight_bytes"] = weight_bytes(session.model)
        if spec["arch"] != "full":
            batches, data_source = _cached_or_synthetic(cfg, family, src, trainable, device)
        else:
            batches = [family.synthetic_batch(trainable, cfg.data.max_resolution, cfg, device)]
        result["data"] = data_source
        result["setup_seconds"] = time.perf_counter() - t0
        # The set-up peak (loading, quantizing, placing) apart from training's: reset after it.
        devices.synchronize(device)
        setup_mem = telemetry.memory(device)
        result["setup_peak_allocated"], result["setup_peak_reserved"] = \
            setup_mem["peak_allocated"], setup_mem["peak_reserved"]
        telemetry.reset_peaks(device)
        stats0 = memory.swapper.stats if memory.swapper else None
        stage = ""  # from here on the session says where an update is (forward, backward, optimizer)
        times = []
        h2d = []
        losses = []  # per update: a fast but wrong path shows here (every setting trains the same math)
        grad_norms: list[float | None] = []  # per update: a backward that broke shows here first
        skipped: list[int] = []  # updates loop.step skipped (a NaN or Inf gradient: nothing applied)
        bad_gradients: list[str | None] = []  # the first non-finite gradient of each of them
        loss_sum = torch.zeros((), device=device)
        accum = cfg.train.grad_accum
        if spec.get("detect_anomaly"):  # each backward checked: the first NaN stops the setting, named
            torch.autograd.set_detect_anomaly(True, check_nan=True)
        for step in range(spec["warmup"] + spec["steps"]):
            session.on_stage = lambda st, step=step: trace(f"update {step + 1}: {st}")
            devices.synchronize(device)
            before = memory.swapper.stats.h2d_bytes if memory.swapper else 0
            t = time.perf_counter()
            micro = (batches[(step * accum + m) % len(batches)] for m in range(accum))
            loop.step(session, loop.simple_micros(micro, torch.Generator(device=device).manual_seed(step)), loss_sum)
            devices.synchronize(device)
            times.append(time.perf_counter() - t)
            h2d.append((memory.swapper.stats.h2d_bytes if memory.swapper else 0) - before)
            # (after the timed window: .item() waits for the device) The update's own loss, counted or
            # skipped: a skipped update (non-finite gradients) adds nothing to loss_sum.
            losses.append(float(session.update_loss.item()))
            grad_norms.append(float(session.grad_norm) if session.grad_norm is not None else None)
            if session.skipped:
                skipped.append(step)
                bad_gradients.append(session.bad_gradient)
            loss_sum.zero_()
            if step == spec["warmup"] - 1 and memory.swapper:
                stats0 = memory.swapper.stats  # the measured updates' copies and stalls start here
        stats1 = memory.swapper.stats if memory.swapper else None
        # One more update, not timed with the others, split into forward / backward / optimizer.
        profile = telemetry.StageTimer(device)

        def mark(st: str) -> None:
            trace(f"profiled update: {st}")
            profile.mark(st)

        session.on_stage = mark
        micro = (batches[m % len(batches)] for m in range(accum))
        loop.step(session, loop.simple_micros(micro, torch.Generator(device=device).manual_seed(10**6)), loss_sum)
        session.on_stage = None
        profiled = profile.seconds()
    except torch.OutOfMemoryError as exc:
        return {**result, "status": "oom", "stage": stage or session.stage, "error": str(exc).splitlines()[0]}
    except ImgloraError as exc:  # e.g. more blocks to swap than the model has
        return {**result, "status": "error", "stage": stage or session.stage, "error": str(exc)}
    measured = times[spec["warmup"]:]
    mem = telemetry.memory(device)
    nonfinite = [i for i, x in enumerate(losses) if not math.isfinite(x) or i in skipped]
    q = statistics.quantiles(measured, n=10) if len(measured) >= 2 else [measured[0]] * 9
    return {**result, "status": "ok", "stage": "done",
            "sec_per_update": {"median": statistics.median(measured), "mean": statistics.fmean(measured),
                               "p10": q[0], "p90": q[-1], "n": len(measured), "warmup": spec["warmup"]},
            "all_update_seconds": times, "losses": losses, "grad_norms": grad_norms,
            # a loss that is NaN or infinite: nothing is trained from there on, whatever the timings say
            "first_nonfinite_update": nonfinite[0] if nonfinite else None,
            "skipped_updates": skipped, "first_nonfinite_gradient": bad_gradients[0] if bad_gradients else None,
            # The first update compiles the blocks (memory.compile): its excess over the median is the compile time.
            "first_update_seconds": times[0], "compile_seconds": times[0] - statistics.median(measured)
            if memory.facts.get("compile") else None, "compile": memory.facts.get("compile"), "peak_allocated": mem["peak_allocated"],
            "peak_reserved": mem["peak_reserved"], "peak_rss": mem["peak_rss"],
            "h2d_bytes_per_update": statistics.fmean(h2d[spec["warmup"]:]) if measured else 0,
            "swap": memory.facts.get("swap"), "fp8": memory.facts.get("fp8"),
            "offload_checkpoints": memory.facts.get("offload_checkpoints"),
            "swap_copies": _copies(stats0, stats1, len(measured)), "profiled_update": profiled}


def _copies(before: Any, after: Any, updates: int) -> dict[str, float] | None:
    """Block copies per measured update, and of those the stalls (a copy issued when the block was
    already needed: not prefetched in time)."""
    if before is None or after is None or updates == 0:
        return None
    return {"loads_per_update": (after.loads - before.loads) / updates,
            "stalls_per_update": (after.demand_loads - before.demand_loads) / updates}


def _cached_or_synthetic(cfg: Any, family: Any, src: "ModelSource", trainable: Any, device: Any) -> tuple[list, str]:
    from ..data import cache
    from ..family import CacheEncoder, supports

    if not supports(family, CacheEncoder):  # a family without an encoder cache: its data is cheap to prepare
        return _batches(family.prepare_data(cfg, src, device).samples, cfg, family, device), "data"
    the_plan = cache.plan(cfg, family, src, device)
    store = cache.Cache(cfg.cache.dir)
    complete = all(store.has("latents", s.key) for s in the_plan.latents) and \
        all(store.has("text", s.key) for s in the_plan.texts.values())
    if not complete:
        return [family.synthetic_batch(trainable, cfg.data.max_resolution, cfg, device)], "synthetic"
    samples = cache.load_samples(cfg, family, src, device, the_plan)
    return _batches(samples, cfg, family, device), "cache"


def _batches(samples: list[Any], cfg: Any, family: Any, device: Any) -> list[dict[str, Any]]:
    """One epoch of training batches, built by the trainer's own batcher (same sizes and grouping)."""
    from ..data.batches import Batcher

    batcher = Batcher(samples, cfg.train.batch_size, cfg.train.seed, collate=family.collate,
                      reg_ratio=cfg.data.reg_ratio)
    return [batcher.batch(i, device) for i in range(batcher.per_epoch)]


def main() -> None:
    from ..util import distributed

    spec_path, result_path = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    result = run_setting(spec)
    distributed.shutdown(True)  # several processes: leave together, before exit-time teardown
    if distributed.rank_from_env() == 0:  # several processes: the main one reports (its own peak memory)
        atomic.write_json(result_path, {**result, "processes": distributed.launched_processes()})


if __name__ == "__main__":
    main()

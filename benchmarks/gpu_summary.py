"""The verdict of the one-shot GPU check (benchmarks/gpu_check.sh): each target with PASS or FAIL.

Reads what the check's steps wrote: the probe's JSON (benchmarks/gpu_probe.py), bench-swap's
bench.json, ``imglora plan``'s plan.json when that command exists, pytest's JUnit XML and the
script's own step log (steps.tsv: step, status, exit code, seconds, note). Prints the targets with
PASS/FAIL and the plan's prediction next to each measured peak, and writes the same as Markdown
ready to paste into docs/benchmarks.md. Standard library only: it must run whatever else is missing.

Targets (FLUX.1-dev, 1024 px, rank 16, batch 1, gradient checkpointing):
- fp8 + 18 swapped blocks: peak allocated < 10 GiB
- fp8 + 18 swapped blocks: seconds per update <= 0.6 s
- fp8:18 / fp8:0 seconds per update <= 1.05
- every per-update loss finite, and fp8:18's equal to fp8:0's within bf16 tolerance (the same weights,
  seeds and batches: the one numerical test of the real path; a NaN run's timings measure nothing)
- the GPU tests (pytest -m gpu) pass

With --dry-run (or without CUDA) every target is "not measured (no GPU)": the CPU figures only show
that each step ran. Exit status: 1 if a target failed or could not be measured on a GPU, or if a
step failed in a dry run; 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

GiB = 2**30
MiB = 2**20

PEAK_LIMIT = 10 * GiB
SPEED_LIMIT = 0.6
RATIO_LIMIT = 1.05

TARGETS = {
    "peak": "fp8 + 18 swapped blocks: peak allocated < 10 GiB",
    "speed": "fp8 + 18 swapped blocks: seconds per update <= 0.6 s",
    "ratio": "fp8:18 / fp8:0 seconds per update <= 1.05",
    "losses": "losses finite at every update, fp8:18 and fp8:0 equal within bf16 tolerance",
    "tests": "GPU tests (pytest -m gpu) pass",
}
NO_GPU = "not measured (no GPU)"
PASS, FAIL, NOT_MEASURED = "PASS", "FAIL", "NOT MEASURED"


def read_json(path: Path | None) -> tuple[dict[str, Any] | None, str | None]:
    """(contents, None) or (None, why not)."""
    if path is None:
        return None, "not given"
    if not path.is_file():
        return None, f"{path} not found"
    try:
        return json.loads(path.read_text()), None
    except (OSError, ValueError) as exc:
        return None, f"{path} unreadable: {exc}"


def read_bench(path: Path | None) -> tuple[dict[str, Any] | None, str | None]:
    """bench.json; if bench-swap was stopped before writing it, the results its finished settings
    left in ``setting-*/result.json`` (marked partial)."""
    bench, why = read_json(path)
    if bench is not None or path is None:
        return bench, why
    results = []
    def index(folder: Path) -> int:
        tail = folder.name.rpartition("-")[2]
        return int(tail) if tail.isdigit() else 0

    for folder in sorted(path.parent.glob("setting-*"), key=index):
        spec, _ = read_json(folder / "spec.json")
        result, _ = read_json(folder / "result.json")
        if spec is None:
            continue
        name = spec.get("setting") or f"{spec.get('precision')}:{spec.get('blocks')}"
        results.append({"setting": name, **result} if result is not None else
                       {"setting": name, "status": "unfinished", "stage": "unknown",
                        "error": "no result.json: bench-swap was stopped during this setting"})
    if not results:
        return None, why
    first = next((r for r in results if "environment" in r), {})
    return {"partial": True, "results": results, "environment": first.get("environment"),
            "preset": "?", "arch": "?", "resolution": "?", "steps": "?", "warmup": "?"}, None


def read_steps(path: Path | None) -> list[dict[str, str]]:
    steps: list[dict[str, str]] = []
    if path is None or not path.is_file():
        return steps
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        cols = (line.split("\t") + [""] * 5)[:5]
        steps.append(dict(zip(("step", "status", "rc", "seconds", "note"), cols)))
    return steps


def read_junit(path: Path | None) -> dict[str, int] | None:
    """Counts of a pytest JUnit XML file: tests, failures, errors, skipped, passed."""
    if path is None or not path.is_file():
        return None
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def gib(n: Any) -> str:
    return "—" if n is None else f"{n / GiB:.2f}"


def by_setting(bench: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {r["setting"]: r for r in (bench or {}).get("results", []) if "setting" in r}


def plan_by_setting(plan: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {s["setting"]: s for s in (plan or {}).get("settings", []) if isinstance(s, dict) and "setting" in s}


def _timed(r: dict[str, Any] | None) -> bool:
    """A result that finished and has its timing (a partial or hand-made one may not)."""
    return (r is not None and r.get("status") == "ok"
            and isinstance((r.get("sec_per_update") or {}).get("median"), (int, float)))


def _not_ok(r: dict[str, Any] | None, name: str) -> str:
    if r is None:
        return f"{name} has no result"
    if r.get("status") == "ok":
        return f"{name}: finished without a timing (sec_per_update)"
    err = (r.get("error") or "").splitlines()
    return f"{name}: {r.get('status')} at stage {r.get('stage', '?')}" + (f" ({err[0][:120]})" if err else "")


def evaluate(bench: dict[str, Any] | None, bench_why: str | None, plan: dict[str, Any] | None,
             junit: dict[str, int] | None, steps: list[dict[str, str]], *, measured: bool, swapped: str,
             reference: str) -> list[dict[str, str]]:
    """One row per target: target, measured, plan (its prediction), verdict."""
    results = by_setting(bench)
    planned = plan_by_setting(plan)
    sw, ref = results.get(swapped), results.get(reference)
    rows = []

    def row(key: str, value: str, verdict: str, predicted: str = "—") -> None:
        rows.append({"target": TARGETS[key], "measured": value, "plan": predicted, "verdict": verdict})

    stand_in = "" if swapped == "fp8:18" else f" ({swapped} stands in for fp8:18)"
    sw_ok, ref_ok = _timed(sw), _timed(ref)
    p = planned.get(swapped, {})
    predicted_peak = f"{gib(p['device_peak_bytes'])} GiB" if p.get("device_peak_bytes") is not None else "—"

    # peak allocated
    if bench is None:
        row("peak", f"no bench result: {bench_why}", NOT_MEASURED if measured else NO_GPU, predicted_peak)
    elif not sw_ok:
        verdict = FAIL if sw is not None and sw.get("status") == "oom" else NOT_MEASURED
        row("peak", _not_ok(sw, swapped), verdict if measured else NO_GPU, predicted_peak)
    elif not measured or sw.get("peak_allocated") is None:
        row("peak", f"CPU dry run{stand_in}: peak RSS {gib(sw.get('peak_rss'))} GiB (host, says nothing of a GPU)",
            NO_GPU, predicted_peak)
    else:
        value = sw["peak_allocated"]
        vs = (f" (measured / plan {value / p['device_peak_bytes']:.2f})" if p.get("device_peak_bytes") else "")
        row("peak", f"{gib(value)} GiB{vs}", PASS if value < PEAK_LIMIT else FAIL, predicted_peak)

    # seconds per update
    if bench is None:
        row("speed", f"no bench result: {bench_why}", NOT_MEASURED if measured else NO_GPU)
    elif not sw_ok:
        row("speed", _not_ok(sw, swapped), NOT_MEASURED if measured else NO_GPU)
    else:
        t = sw["sec_per_update"]["median"]
        if measured:
            row("speed", f"{t:.3f} s (median of {sw['sec_per_update'].get('n', '?')})",
                PASS if t <= SPEED_LIMIT else FAIL)
        else:
            row("speed", f"CPU dry run{stand_in}: {t:.3f} s", NO_GPU)

    # ratio
    if bench is None:
        row("ratio", f"no bench result: {bench_why}", NOT_MEASURED if measured else NO_GPU)
    elif not (sw_ok and ref_ok):
        why = "; ".join(_not_ok(r, n) for r, n, ok in ((sw, swapped, sw_ok), (ref, reference, ref_ok)) if not ok)
        row("ratio", why, NOT_MEASURED if measured else NO_GPU)
    else:
        ratio = sw["sec_per_update"]["median"] / ref["sec_per_update"]["median"]
        if measured:
            row("ratio", f"{ratio:.3f} ({sw['sec_per_update']['median']:.3f} / {ref['sec_per_update']['median']:.3f} s)",
                PASS if ratio <= RATIO_LIMIT else FAIL)
        else:
            row("ratio", f"CPU dry run{stand_in}: {ratio:.3f}", NO_GPU)

    # losses: finite, and the same math with and without swapping
    if bench is None:
        row("losses", f"no bench result: {bench_why}", NOT_MEASURED if measured else NO_GPU)
    else:
        row("losses", *losses_verdict(bench, sw, ref, swapped, reference, measured))

    # GPU tests
    step = next((s for s in steps if s["step"] == "pytest"), None)
    if step is None or step["status"] == "skipped":
        why = step["note"] if step and step["note"] else "pytest did not run"
        row("tests", f"not run: {why}", NOT_MEASURED if measured else NO_GPU)
    elif junit is None:
        row("tests", f"pytest {step['status']} (exit {step['rc']}), no JUnit report",
            FAIL if measured else NO_GPU)
    else:
        text = (f"{junit['passed']} passed, {junit['failures']} failed, {junit['errors']} errors, "
                f"{junit['skipped']} skipped (exit {step['rc']})")
        if not measured:
            row("tests", f"CPU dry run: {text}", NO_GPU)
        else:
            good = step["rc"] == "0" and junit["failures"] == 0 and junit["errors"] == 0 and junit["passed"] > 0
            row("tests", text, PASS if good else FAIL)
    return rows


def _first_nonfinite(r: dict[str, Any]) -> int | None:
    """The first update (0-based) whose loss was not finite or whose gradients were (then skipped)."""
    bad = [i for i, x in enumerate(r.get("losses") or []) if not (isinstance(x, (int, float)) and abs(x) < float("inf"))
           or i in (r.get("skipped_updates") or ())]
    return bad[0] if bad else None


def _bad_text(r: dict[str, Any], bad: int) -> str:
    if bad in (r.get("skipped_updates") or ()):
        return (f"gradients not finite at update {bad + 1} of {len(r['losses'])}, skipped "
                f"(first in {r.get('first_nonfinite_gradient')}; {len(r['skipped_updates'])} skipped)")
    return f"loss {r['losses'][bad]} at update {bad + 1} of {len(r['losses'])}"


def losses_verdict(bench: dict[str, Any], sw: dict[str, Any] | None, ref: dict[str, Any] | None, swapped: str,
                   reference: str, measured: bool) -> tuple[str, str]:
    """(measured, verdict) of the losses target: every finished setting's losses finite, and the
    swapped setting's equal to the reference's (bench-swap's own loss_agreement)."""
    done = [r for r in bench.get("results", []) if r.get("status") == "ok"]
    if not done:
        return "no setting finished", NOT_MEASURED if measured else NO_GPU
    parts, good = [], True
    for r in done:
        bad = _first_nonfinite(r)
        if bad is not None:
            good = False
            parts.append(f"{r['setting']}: {_bad_text(r, bad)}")
    pair = next((a for a in bench.get("loss_agreement", [])
                 if {a.get("reference"), a.get("setting")} == {reference, swapped}), None)
    if pair is not None:
        parts.append(pair["text"])
        good = good and bool(pair.get("agree"))
    elif not (sw and sw.get("status") == "ok" and ref and ref.get("status") == "ok"):
        parts.append(f"{swapped} vs {reference}: not both finished")
        good = False
    text = "; ".join(parts) or "finite"
    if not measured:
        return f"CPU dry run: {text}", NO_GPU
    return text, PASS if good else FAIL


def bench_rows(bench: dict[str, Any] | None, plan: dict[str, Any] | None) -> list[list[str]]:
    planned = plan_by_setting(plan)
    out = []
    for r in (bench or {}).get("results", []):
        p = planned.get(r.get("setting"), {})
        if not _timed(r):
            out.append([r.get("setting", "?"), _not_ok(r, r.get("setting", "?"))] + ["—"] * 8
                       + [gib(p.get("device_peak_bytes")), gib(p.get("host_peak_bytes"))])
            continue
        t = r["sec_per_update"]
        bad = _first_nonfinite(r)
        out.append([r["setting"], "ok" if bad is None else f"ok, loss NaN from update {bad + 1}", f"{t['median']:.3f}", f"{t['p10']:.3f}", f"{t['p90']:.3f}",
                    gib(r.get("peak_allocated")), gib(r.get("peak_reserved")), gib(r.get("peak_rss")),
                    f"{(r.get('h2d_bytes_per_update') or 0) / MiB:.1f}",
                    "—" if r.get("setup_seconds") is None else f"{r['setup_seconds']:.1f}",
                    gib(p.get("device_peak_bytes")), gib(p.get("host_peak_bytes"))])
    return out


BENCH_COLUMNS = ["setting", "status", "s/update median", "p10", "p90", "peak alloc GiB", "peak reserved GiB",
                 "peak RSS GiB", "H2D MiB/update", "setup s", "plan: device peak GiB", "plan: host peak GiB"]


def probe_rows(probe: dict[str, Any] | None) -> list[list[str]]:
    if not probe:
        return []
    if not probe.get("cuda"):
        return [["CUDA", probe.get("reason") or probe.get("error") or "no CUDA device"]]
    rows = []
    env = probe.get("environment", {})
    if "error" not in env:
        rows.append(["GPU", f"{env.get('gpu')}, compute capability {env.get('compute_capability')}, "
                            f"{(env.get('total_memory_bytes') or 0) / GiB:.1f} GiB"])
        rows.append(["driver / CUDA runtime / torch", f"{env.get('driver')} / {env.get('cuda_runtime')} / "
                                                      f"{env.get('torch')}"])
        rows.append(["PCIe link (gen, width)", str(env.get("pcie"))])
    bw = probe.get("bandwidth", {})
    if "error" in bw:
        rows.append(["bandwidth", bw["error"]])
    else:
        for key, label in (("h2d_pinned", "host→device, pinned"), ("h2d_pageable", "host→device, pageable"),
                           ("d2h_pinned", "device→host, pinned"), ("d2h_pageable", "device→host, pageable")):
            if key in bw:
                rows.append([f"{label} ({bw['bytes'] // MiB} MiB)", f"{bw[key]['gbps']:.1f} GB/s"])
    ov = probe.get("overlap", {})
    if "error" in ov:
        rows.append(["copy/compute overlap", ov["error"]])
    elif ov:
        rows.append(["copy/compute overlap ratio (1.0 = perfect)",
                     f"{ov['overlap_ratio']:.2f} (copy {ov['copy_seconds'] * 1e3:.1f} ms, compute "
                     f"{ov['compute_seconds'] * 1e3:.1f} ms, both {ov['both_seconds'] * 1e3:.1f} ms)"])
    f = probe.get("fp8", {})
    if "error" in f:
        rows.append(["fp8 matmul", f["error"]])
    elif f:
        bf16 = f.get("bf16_tflops", {})
        rows.append([f"bf16 matmul {f.get('shape')}", f"{bf16['tflops']:.0f} TFLOPS" if "tflops" in bf16
                     else str(bf16.get("error"))])
        s = f.get("scaled_mm", {})
        rows.append(["fp8 tensor cores (cc ≥ 8.9)", "yes" if f.get("fp8_tensor_cores") else "no"])
        rows.append(["torch._scaled_mm fp8", f"{s['tflops']:.0f} TFLOPS" if "tflops" in s
                     else str(s.get("error") or s.get("skipped"))])
        if "speedup_vs_bf16" in f:
            rows.append(["fp8 / bf16 throughput", f"{f['speedup_vs_bf16']:.2f}×"])
    return rows


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    def cell(x: Any) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    return ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(map(cell, r)) + " |" for r in rows]


def text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    all_rows = [header] + rows
    widths = [max(len(str(r[i])) for r in all_rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in all_rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return ["  " + line for line in lines]


def bench_command(bench: dict[str, Any] | None) -> str:
    if not bench:
        return "imglora bench-swap (no result)"
    if bench.get("partial"):
        return "imglora bench-swap (stopped before bench.json was written: the settings that finished)"
    blocks = ",".join(r.get("setting", "?") for r in bench.get("results", []))
    parts = [f"imglora bench-swap {bench.get('preset')}"]
    if bench.get("arch") == "full":
        parts.append("--arch full")
    parts += [f"--resolution {bench.get('resolution')}", f"--blocks {blocks}", f"--steps {bench.get('steps')}",
              f"--warmup {bench.get('warmup')}"]
    return " ".join(parts)


def prefetch_lines(bench: dict[str, Any] | None) -> list[str]:
    """What the swap prefetch chose in each setting (memory.swap_prefetch = 0: from its measured
    copy and block compute times), as the run record keeps it."""
    lines = []
    for r in (bench or {}).get("results", []):
        pf = ((r.get("swap") or {}).get("prefetch")) or {}
        if not pf:
            continue
        how = "auto" if pf.get("auto") else "set"
        extra = [f"+{pf['extra_device_bytes'] / GiB:.2f} GiB of slots"] if pf.get("extra_device_bytes") else []
        for key, label in (("copy_ms", "copy ms"), ("compute_ms", "compute ms"), ("forward_stall_ms", "forward stall ms by depth")):
            if pf.get(key):
                extra.append(f"{label} " + ", ".join(f"{k}: {v}" for k, v in pf[key].items()))
        if pf.get("reason"):
            extra.append(pf["reason"])
        if pf.get("limited_by_memory"):
            extra.append("limited by free memory")
        lines.append(f"{r.get('setting')}: prefetch {pf.get('depth')} block(s) ahead ({how})"
                     + (f"; {'; '.join(extra)}" if extra else ""))
    return lines


# The replay's estimate of FLUX.1-dev's forward compute at 1024 px over all blocks (docs/benchmarks.md:
# "Swap prefetch depth"), which the measured per-block compute is set against.
FORWARD_COMPUTE_ESTIMATE_MS = 134.9


def detail_lines(bench: dict[str, Any] | None) -> list[str]:
    """Per setting, what the check records beside the table: the profiled update's split, the
    set-up peak (training's peaks are reset after it), block copies and stalls per update, the
    page-locked host memory, the measured forward compute against the estimate."""
    lines = []
    for r in (bench or {}).get("results", []):
        if r.get("status") != "ok":
            continue
        parts = []
        prof = r.get("profiled_update") or {}
        if prof:
            parts.append("profiled update: " + ", ".join(f"{k} {prof[k]:.3f} s" for k in
                                                         ("forward", "backward", "optimizer", "total") if k in prof))
        if r.get("setup_peak_allocated") is not None:
            parts.append(f"set-up peak {gib(r['setup_peak_allocated'])} allocated / "
                         f"{gib(r.get('setup_peak_reserved'))} reserved GiB (reset before training)")
        copies = r.get("swap_copies")
        if copies:
            parts.append(f"{copies['loads_per_update']:.1f} block copies per update, "
                         f"{copies['stalls_per_update']:.1f} of them stalls")
        held = {**{f"swapped blocks {k}": v for k, v in ((r.get("swap") or {}).get("host_memory") or {}).items()},
                **{f"boundaries {k}": v for k, v in
                   ((r.get("offload_checkpoints") or {}).get("host_memory") or {}).items()}}
        if held:
            parts.append("host memory: " + ", ".join(f"{k} {gib(v)} GiB" for k, v in held.items()))
        fwd = ((r.get("swap") or {}).get("prefetch") or {}).get("forward_compute_ms")
        if fwd:
            parts.append(f"forward compute, all blocks: {fwd:.1f} ms (estimate {FORWARD_COMPUTE_ESTIMATE_MS} ms)")
        if parts:
            lines.append(f"{r.get('setting')}: " + "; ".join(parts))
    return lines


def environment_line(bench: dict[str, Any] | None, probe: dict[str, Any] | None) -> str:
    env = (bench or {}).get("environment") or {}
    if env:
        keys = ("device_name", "driver", "cuda", "torch", "diffusers", "peft", "optimum-quanto", "python")
        return ", ".join(f"{k} {env.get(k)}" for k in keys if env.get(k) is not None)
    if probe and probe.get("cuda"):
        e = probe.get("environment", {})
        return f"{e.get('gpu')}, driver {e.get('driver')}, CUDA {e.get('cuda_runtime')}, torch {e.get('torch')}"
    return "unknown (no bench result)"


DIAGNOSES = (("diagnose-math", "math attention kernel, asynchronous"),
             ("diagnose", "CUDA_LAUNCH_BLOCKING=1 with autograd anomaly detection"),
             ("bench-sdxl", "SDXL (full UNet)"), ("bench-llm", "chat LLM (full architecture, 4-bit base)"),
             ("bench-z-image", "Z-Image Turbo (full architecture)"),
             ("bench-flux2-klein", "FLUX.2 [klein] base 4B (full architecture)"),
             ("bench-krea2", "Krea 2 Raw (full architecture)"),
             ("bench-qwen-image-2.1", "Qwen-Image 2.1 (full architecture)"))


def diagnosis_lines(folder: Path | None) -> list[str]:
    """What the bare bisect (DIR/bisect), the diagnose step's runs (DIR/diagnose-math, DIR/diagnose)
    and the families steps' benches (DIR/bench-sdxl, DIR/bench-llm, DIR/bench-<new family>) found: per run, its losses and
    whether they and the gradients are finite, or how it failed."""
    out = bisect_lines(folder / "bisect") if folder is not None else []
    for sub, label in DIAGNOSES:
        if folder is None:
            break
        bench, why = read_bench(folder / sub / "bench.json")
        if bench is None:
            if (folder / sub).exists():
                out.append(f"{label}: no result ({why})")
            continue
        for r in bench.get("results", []):
            losses = r.get("losses") or []
            bad = _first_nonfinite(r) if losses else None
            shown = ", ".join(f"{x:.6f}" if isinstance(x, (int, float)) else str(x) for x in losses)
            if r.get("status") == "ok":
                speed = (f"; {r['sec_per_update']['median']:.3f} s/update, peak {gib(r.get('peak_allocated'))} GiB "
                         f"allocated, {gib(r.get('peak_reserved'))} GiB reserved" if _timed(r) else "")
                out.append(f"{label}, {r.get('setting')}: losses [{shown}] "
                           + ("all finite" if losses and bad is None else "NOT FINITE: " + (
                               _bad_text(r, bad) if bad is not None else "no loss")) + speed)
            else:
                out.append(f"{label}, {r.get('setting')}: {r.get('status')} in {r.get('stage')}: "
                           f"{str(r.get('error') or '').strip()[:300]}")
    return out


def bisect_lines(folder: Path) -> list[str]:
    """benchmarks/bare_bisect.py's summary: the cause it points to, FLUX at 1024 px per kernel, the
    kernel to run imglora with."""
    summary, why = read_json(folder / "summary.json")
    if summary is None:
        return [f"bare control (no imglora): no result ({why})"] if folder.exists() else []
    kernels = ", ".join(f"{k}: {v}" for k, v in summary.get("flux_1024", {}).items()) or "none ran"
    return [f"bare control (no imglora): {summary.get('cause')}",
            f"bare control, FLUX.1-dev 1024 px per kernel (PyTorch's default here: "
            f"{summary.get('default_kernel') or 'unknown'}): {kernels}; kernel to use: {summary.get('kernel') or 'none found'}"]


def render(args: argparse.Namespace) -> tuple[str, str, int, list[dict[str, str]]]:
    """(text for the terminal, Markdown, exit status, the target rows)."""
    probe, probe_why = read_json(args.probe)
    bench, bench_why = read_bench(args.bench)
    plan, plan_why = read_json(args.plan)
    steps = read_steps(args.steps)
    junit = read_junit(args.junit)
    cuda = bool(probe and probe.get("cuda"))
    bench_on_cuda = any(r.get("device") == "cuda" for r in (bench or {}).get("results", []))
    measured = not args.dry_run and (cuda or bench_on_cuda)
    rows = evaluate(bench, bench_why, plan, junit, steps, measured=measured, swapped=args.swapped,
                    reference=args.reference)
    date = time.strftime("%Y-%m-%d %H:%M")
    if args.dry_run:
        title = f"One-shot GPU check: DRY RUN on CPU ({date}), no GPU figure"
    elif not measured:
        title = f"One-shot GPU check ({date}): ran WITHOUT CUDA, no GPU figure"
    else:
        title = f"One-shot GPU check: {(probe or {}).get('environment', {}).get('gpu', 'GPU')} ({date})"
    plan_step = next((s for s in steps if s["step"] == "plan"), None)
    if plan is None and plan_step is not None and plan_step["status"] != "ok" and plan_step["note"]:
        plan_why = plan_step["note"]  # e.g. "imglora plan not available"
    plan_note = (f"plan: {args.plan}" if plan is not None else
                 f"plan: not available ({plan_why}); predictions left blank")
    fit = plan.get("fastest_fit") if plan else None

    failed_steps = [s for s in steps if s["status"] in ("failed", "timeout")]
    verdicts = [r["verdict"] for r in rows]
    if measured:
        rc = 0 if all(v == PASS for v in verdicts) else 1
        overall = ("ALL TARGETS PASS" if rc == 0 else
                   f"{sum(v == FAIL for v in verdicts)} FAIL, {sum(v == NOT_MEASURED for v in verdicts)} NOT MEASURED")
    else:
        # Without --dry-run the check was meant to measure: finding no GPU is a failure.
        rc = 1 if failed_steps or not args.dry_run else 0
        overall = ("DRY RUN: targets not measured (no GPU)" if args.dry_run else
                   "FAILED: no CUDA device was usable, targets not measured")
        if failed_steps:
            overall += f"; {len(failed_steps)} step(s) failed: " + ", ".join(s["step"] for s in failed_steps)

    target_rows = [[r["target"], r["measured"], r["plan"], r["verdict"]] for r in rows]
    text = [title, f"  {overall}", "", "Targets:"]
    text += [f"  {r['verdict']:<22} {r['target']}: {r['measured']}" + (f"  (plan predicts {r['plan']})"
                                                                        if r["plan"] != "—" else "") for r in rows]
    text += ["", f"Bench: {bench_command(bench)}"]
    text += text_table(BENCH_COLUMNS, bench_rows(bench, plan)) if bench else [f"  no result: {bench_why}"]
    text += [f"  {plan_note}" + (f"; fastest setting that fits: {fit}" if plan else "")]
    text += [f"  {line}" for line in prefetch_lines(bench) + detail_lines(bench)]
    diagnosis = diagnosis_lines(getattr(args, "diagnose", None))
    if diagnosis:
        text += ["", "Diagnosis:"] + [f"  {line}" for line in diagnosis]
    text += ["", "Probe:"] + ([f"  {k}: {v}" for k, v in probe_rows(probe)] or [f"  no result: {probe_why}"])
    if steps:
        text += ["", "Steps:"] + text_table(["step", "status", "exit", "seconds", "note"],
                                             [[s["step"], s["status"], s["rc"], s["seconds"], s["note"]] for s in steps])

    md = [f"### {title}", "", f"**{overall}.** Environment: {environment_line(bench, probe)}.", ""]
    if args.dry_run or not measured:
        md += ["*No GPU was used: every figure below comes from the CPU and says nothing about a GPU; "
               "the dry run only shows that each step of the check runs.*", ""]
    md += md_table(["target", "measured", "plan predicts", "verdict"], target_rows) + [""]
    md += [f"`{bench_command(bench)}`", ""]
    md += (md_table(BENCH_COLUMNS, bench_rows(bench, plan)) if bench else [f"No bench result: {bench_why}."]) + [""]
    md += [f"{plan_note}" + (f"; fastest setting that fits: `{fit}`." if plan else "."), ""]
    extra = prefetch_lines(bench) + detail_lines(bench)
    md += [f"- {line}" for line in extra] + ([""] if extra else [])
    if plan:
        for s in plan.get("settings", []):
            terms = s.get("terms") or {}
            if terms:
                md += [f"Plan terms for `{s.get('setting')}`: " + ", ".join(
                    f"{k} {v / GiB:.2f} GiB" for k, v in terms.items() if isinstance(v, (int, float))) + ".", ""]
    if diagnosis:
        md += ["Diagnosis (the bench crashed or trained a NaN):", ""] + [f"- {line}" for line in diagnosis] + [""]
    md += ["`python benchmarks/gpu_probe.py`:", ""]
    md += (md_table(["figure", "value"], probe_rows(probe)) if probe else [f"No probe result: {probe_why}."]) + [""]
    if steps:
        md += md_table(["step", "status", "exit", "seconds", "note"],
                       [[s["step"], s["status"], s["rc"], s["seconds"], s["note"]] for s in steps]) + [""]
    return "\n".join(text), "\n".join(md), rc, rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probe", type=Path, help="gpu_probe.py's JSON")
    ap.add_argument("--bench", type=Path, help="bench-swap's bench.json")
    ap.add_argument("--plan", type=Path, help="imglora plan's JSON (optional)")
    ap.add_argument("--junit", type=Path, help="pytest's JUnit XML")
    ap.add_argument("--steps", type=Path, help="the check's step log (tab-separated)")
    ap.add_argument("--md", type=Path, help="write the Markdown summary here")
    ap.add_argument("--diagnose", type=Path, help="the check's folder: its diagnose-math/ and diagnose/ runs")
    ap.add_argument("--dry-run", action="store_true", help="a CPU dry run: no target is measured")
    ap.add_argument("--swapped", default="fp8:18", help="the setting the swap targets are about (default fp8:18)")
    ap.add_argument("--reference", default="fp8:0", help="the setting without swap (default fp8:0)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text, md, rc, _ = render(args)
    print(text)
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(md + "\n")
        print(f"\nwritten: {args.md}")
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""What a CUDA machine offers the FLUX memory path: copy bandwidth, copy/compute overlap, fp8 matmuls.

Block swapping streams frozen weights host-to-device on a side stream while the compute stream
runs, and the fp8 base stores weights in float8. How well that works on a given machine depends on
numbers this script measures in well under a minute:

(a) bandwidth, GB/s (10^9 bytes/s): host->device from pinned and from pageable memory, and
    device->host into pinned and pageable memory; 256 MiB per transfer, timed with CUDA events,
    the median of a few repeats after one warm-up;
(b) copy/compute overlap: a loop of bf16 matmuls alone, pinned host->device copies alone on a side
    stream, and both together. Overlap ratio = (t_copy + t_compute - t_both) / min(t_copy,
    t_compute): 1.0 when the shorter one hides entirely behind the longer, 0 when they serialize;
(c) fp8 tensor cores (compute capability >= 8.9): ``torch._scaled_mm`` throughput against a bf16
    matmul on a 4096x3072 @ 3072x3072 product (a FLUX projection at 1024 px is 4096 tokens x 3072);
    any failure is recorded as its error string;
(d) the GPU, driver, CUDA runtime, torch version and total memory;
(e) attention at FLUX.1's 1024 px shape (24 heads, 4096 + 512 tokens, head size 128): each of
    scaled_dot_product_attention's kernels (flash, memory-efficient, cuDNN, and the math one in
    bf16) forward and backward on one set of random inputs, against the math kernel in float32:
    whether outputs and gradients are finite, their largest error relative to the reference's
    largest value, and milliseconds per forward + backward; the default kernel order. The first
    H200 run trained NaN from the second update in every setting: this says at once whether an
    attention kernel is the cause. Last, since a kernel that faults spoils the CUDA context.

Needs torch only (not imglora). Without a CUDA device it prints "no CUDA device: probe skipped",
writes {"cuda": false, ...} and exits 0, so a CPU dry run works.

    python benchmarks/gpu_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

MiB = 2**20
GB = 1e9
OVERLAP_MATMUL = 4096          # side of the square bf16 matmuls run against the copies
OVERLAP_COPIES = 8             # pinned host->device copies of --size-mib each, on the side stream
FP8_SHAPE = (4096, 3072, 3072)  # m, k, n: (m x k) @ (k x n), a FLUX projection at 1024 px
MATMUL_ITERS = 50              # matmuls per timed repeat in (c)
ATTN_SHAPE = (1, 24, 4608, 128)  # batch, heads, tokens, head size: FLUX.1 at 1024 px, in (e)
ATTN_KERNELS = (("flash", "FLASH_ATTENTION", "bfloat16"), ("efficient", "EFFICIENT_ATTENTION", "bfloat16"),
                ("cudnn", "CUDNN_ATTENTION", "bfloat16"), ("math_bf16", "MATH", "bfloat16"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the figures to this JSON file")
    ap.add_argument("--size-mib", type=int, default=256, help="bytes per transfer, MiB (default 256)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per figure (default 5; the median is kept)")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError as exc:
        result: dict[str, Any] = {"cuda": False, "torch": None, "error": f"torch is not importable: {exc}"}
        print(f"torch is not importable ({exc}): probe skipped")
        _write(args.out, result)
        return 2
    if not torch.cuda.is_available():
        result = {"cuda": False, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                  "python": platform.python_version(), "reason": "torch.cuda.is_available() is False"}
        print("no CUDA device: probe skipped")
        _write(args.out, result)
        return 0
    result = probe(torch, args.size_mib * MiB, max(1, args.repeats))
    print(summary(result))
    _write(args.out, result)
    return 0


def _write(path: Path | None, result: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)
    print(f"written: {path}")


def _guard(section: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A section's figures, or the error that stopped it (the other sections still run)."""
    try:
        return section()
    except Exception as exc:  # noqa: BLE001 -- any failure is a finding to record, not a crash
        return {"error": f"{type(exc).__name__}: {exc}"}


def probe(torch: Any, nbytes: int, repeats: int) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    result: dict[str, Any] = {"cuda": True, "environment": _guard(lambda: environment(torch, device))}
    result["bandwidth"] = _guard(lambda: bandwidth(torch, device, nbytes, repeats))
    torch.cuda.empty_cache()
    result["overlap"] = _guard(lambda: overlap(torch, device, nbytes, repeats))
    torch.cuda.empty_cache()
    result["fp8"] = _guard(lambda: fp8_matmul(torch, device, repeats))
    torch.cuda.empty_cache()
    result["attention"] = _guard(lambda: attention(torch, device, repeats))
    result["probe_seconds"] = round(time.perf_counter() - t0, 2)
    return result


# ------------------------------------------------------------------------------------------ (d)


def _nvidia_smi(query: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if lines else None


def environment(torch: Any, device: Any) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(device)
    cc = torch.cuda.get_device_capability(device)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"gpu": props.name, "compute_capability": f"{cc[0]}.{cc[1]}", "total_memory_bytes": props.total_memory,
            "multiprocessors": props.multi_processor_count, "device_count": torch.cuda.device_count(),
            "driver": _nvidia_smi("driver_version"),
            "pcie": _nvidia_smi("pcie.link.gen.current,pcie.link.width.current"),
            "cuda_runtime": torch.version.cuda, "cudnn": cudnn, "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


# ------------------------------------------------------------------------------------------ (a)


def _events(torch: Any) -> tuple[Any, Any]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def _timed_copy(torch: Any, dst: Any, src: Any, non_blocking: bool) -> tuple[float, float]:
    """(seconds by CUDA events, seconds by the host clock) of one ``dst.copy_(src)``."""
    start, end = _events(torch)
    torch.cuda.synchronize()
    wall = time.perf_counter()
    start.record()
    dst.copy_(src, non_blocking=non_blocking)
    end.record()
    end.synchronize()
    wall = time.perf_counter() - wall
    return start.elapsed_time(end) / 1e3, wall


def bandwidth(torch: Any, device: Any, nbytes: int, repeats: int) -> dict[str, Any]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pinned.fill_(1)
    pageable.fill_(1)  # touch every page, so first-touch faults are not timed
    dev.fill_(1)
    cases = {"h2d_pinned": (dev, pinned, True), "h2d_pageable": (dev, pageable, False),
             "d2h_pinned": (pinned, dev, True), "d2h_pageable": (pageable, dev, False)}
    out: dict[str, Any] = {"bytes": nbytes, "repeats": repeats, "unit": "GB/s (1e9 bytes/s)"}
    for name, (dst, src, non_blocking) in cases.items():
        _timed_copy(torch, dst, src, non_blocking)  # warm-up
        times = [_timed_copy(torch, dst, src, non_blocking) for _ in range(repeats)]
        ev = statistics.median(t for t, _ in times)
        wall = statistics.median(w for _, w in times)
        out[name] = {"gbps": nbytes / ev / GB, "gbps_wall": nbytes / wall / GB,
                     "seconds": [round(t, 6) for t, _ in times]}
    return out


# ------------------------------------------------------------------------------------------ (b)


def _busy(torch: Any) -> None:
    """Keep the compute stream busy for a few ms, so that what is queued next is all queued before
    any of it starts (the host's launch pace then does not enter the timings)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(50_000_000)


def overlap(torch: Any, device: Any, nbytes: int, repeats: int) -> dict[str, Any]:
    side = torch.cuda.Stream(device=device)
    main = torch.cuda.current_stream(device)
    n_copies, side_n = OVERLAP_COPIES, OVERLAP_MATMUL
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    a = torch.randn(side_n, side_n, device=device, dtype=torch.bfloat16)
    b = torch.randn(side_n, side_n, device=device, dtype=torch.bfloat16)
    c = torch.empty(side_n, side_n, device=device, dtype=torch.bfloat16)

    def run(copies: bool, matmuls: int) -> float:
        torch.cuda.synchronize()
        start, end = _events(torch)
        copied = torch.cuda.Event()
        _busy(torch)
        start.record(main)
        if copies:
            side.wait_event(start)
            with torch.cuda.stream(side):
                for _ in range(n_copies):
                    dst.copy_(src, non_blocking=True)
                copied.record(side)
        for _ in range(matmuls):
            torch.matmul(a, b, out=c)
        if copies:
            main.wait_event(copied)
        end.record(main)
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    run(True, 10)  # warm-up: cuBLAS handles, pinned paths
    t_copy = statistics.median(run(True, 0) for _ in range(repeats))
    per_mm = statistics.median(run(False, 20) for _ in range(3)) / 20
    n_mm = max(10, min(20_000, math.ceil(t_copy / per_mm)))  # compute as long as the copies
    t_compute = statistics.median(run(False, n_mm) for _ in range(repeats))
    t_both = statistics.median(run(True, n_mm) for _ in range(repeats))
    ratio = (t_copy + t_compute - t_both) / min(t_copy, t_compute)
    return {"copy_seconds": t_copy, "compute_seconds": t_compute, "both_seconds": t_both, "overlap_ratio": ratio,
            "copies": n_copies, "copy_bytes_each": nbytes, "matmuls": n_mm, "matmul_shape": [side_n] * 3,
            "copy_gbps_alone": n_copies * nbytes / t_copy / GB,
            "matmul_tflops_alone": 2 * side_n**3 * n_mm / t_compute / 1e12,
            "sleep_kernel": getattr(torch.cuda, "_sleep", None) is not None,
            "meaning": "1.0 = the shorter of copy and compute hidden entirely behind the other; 0 = serialized"}


# ------------------------------------------------------------------------------------------ (c)


def _tflops(torch: Any, fn: Callable[[], Any], flops: float, repeats: int) -> float:
    iters = MATMUL_ITERS
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = _events(torch)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return flops / statistics.median(times) / 1e12


def fp8_matmul(torch: Any, device: Any, repeats: int) -> dict[str, Any]:
    m, k, n = FP8_SHAPE
    flops = 2.0 * m * k * n
    cc = torch.cuda.get_device_capability(device)
    out: dict[str, Any] = {"shape": f"{m}x{k} @ {k}x{n}", "compute_capability": f"{cc[0]}.{cc[1]}",
                           "fp8_tensor_cores": tuple(cc) >= (8, 9)}
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    out["bf16_tflops"] = _guard(lambda: {"tflops": _tflops(torch, lambda: torch.matmul(a, b), flops, repeats)})
    if not out["fp8_tensor_cores"]:
        out["scaled_mm"] = {"skipped": "compute capability below 8.9: no fp8 tensor cores"}
        return out
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None or not hasattr(torch, "_scaled_mm"):
        out["scaled_mm"] = {"error": "this torch has no float8_e4m3fn or no torch._scaled_mm"}
        return out
    a8 = a.to(fp8)
    b8 = b.t().contiguous().to(fp8).t()  # _scaled_mm wants the second operand column-major
    one = torch.ones((), device=device, dtype=torch.float32)

    def scaled(fast: bool) -> Any:
        r = torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast)
        return r[0] if isinstance(r, tuple) else r  # torch < 2.4 returned (out, amax)

    def check() -> dict[str, Any]:
        ref = torch.matmul(a8.to(torch.bfloat16), b8.to(torch.bfloat16)).float()
        got = scaled(False).float()
        return {"max_rel_error_vs_bf16_of_fp8_inputs": float((got - ref).abs().max() / ref.abs().max())}

    out["scaled_mm"] = _guard(lambda: {**check(), "tflops": _tflops(torch, lambda: scaled(False), flops, repeats)})
    out["scaled_mm_fast_accum"] = _guard(lambda: {"tflops": _tflops(torch, lambda: scaled(True), flops, repeats)})
    bf16 = out["bf16_tflops"].get("tflops")
    fp8_t = out["scaled_mm"].get("tflops")
    if bf16 and fp8_t:
        out["speedup_vs_bf16"] = fp8_t / bf16
    return out


# ------------------------------------------------------------------------------------------ (e)


def _max_rel(torch: Any, got: Any, ref: Any) -> float:
    return float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def attention(torch: Any, device: Any, repeats: int) -> dict[str, Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, w = (torch.randn(ATTN_SHAPE, generator=g, device=device, dtype=torch.bfloat16) for _ in range(4))

    def run(backend: Any, dtype: Any) -> tuple[Any, list[Any]]:
        leaves = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v)]  # fresh leaves: no gradient adds up
        with sdpa_kernel([backend]):
            o = sdpa(*leaves)
            o.backward(w.to(dtype))  # w: the upstream gradient
        return o.detach(), [t.grad for t in leaves]

    ref_o, ref_g = run(SDPBackend.MATH, torch.float32)
    out: dict[str, Any] = {"shape": list(ATTN_SHAPE), "reference": "math kernel, float32"}
    try:
        order = torch._C._get_sdp_priority_order()
        names = {int(getattr(SDPBackend, n)): short for n, short in (
            ("MATH", "math"), ("FLASH_ATTENTION", "flash"), ("EFFICIENT_ATTENTION", "efficient"),
            ("CUDNN_ATTENTION", "cudnn"), ("OVERRIDEABLE", "overrideable")) if hasattr(SDPBackend, n)}
        out["default_order"] = [names.get(int(b), str(b)) for b in order]
    except Exception as exc:  # noqa: BLE001 -- a private API: its absence is recorded, not fatal
        out["default_order"] = f"unknown ({type(exc).__name__})"

    def one(backend: Any, dtype: Any) -> dict[str, Any]:
        o, grads = run(backend, dtype)
        finite = bool(torch.isfinite(o).all()) and all(bool(torch.isfinite(x).all()) for x in grads)
        errors = {"out": _max_rel(torch, o, ref_o.float()),
                  **{f"grad_{n}": _max_rel(torch, x, r.float()) for n, x, r in zip("qkv", grads, ref_g)}}
        times = []
        for _ in range(repeats):
            start, end = _events(torch)
            start.record()
            run(backend, dtype)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return {"finite": finite, "max_rel_error": max(errors.values()), "errors": errors,
                "ms_forward_backward": statistics.median(times)}

    for name, backend, dtype in ATTN_KERNELS:
        if not hasattr(SDPBackend, backend):
            out[name] = {"error": f"this torch has no SDPBackend.{backend}"}
            continue
        out[name] = _guard(lambda b=getattr(SDPBackend, backend), d=getattr(torch, dtype): one(b, d))
    return out


# -------------------------------------------------------------------------------------- report


def summary(r: dict[str, Any]) -> str:
    lines = ["GPU probe"]
    env = r.get("environment", {})
    if "error" in env:
        lines.append(f"  environment: {env['error']}")
    else:
        lines.append(f"  {env['gpu']} (compute capability {env['compute_capability']}, "
                     f"{env['total_memory_bytes'] / 2**30:.1f} GiB), driver {env['driver']}, CUDA runtime "
                     f"{env['cuda_runtime']}, torch {env['torch']}, PCIe {env['pcie']}")
    bw = r.get("bandwidth", {})
    if "error" in bw:
        lines.append(f"  bandwidth: {bw['error']}")
    else:
        lines.append(f"  bandwidth, {bw['bytes'] // MiB} MiB transfers, median of {bw['repeats']} (GB/s):")
        for name in ("h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable"):
            lines.append(f"    {name:13s} {bw[name]['gbps']:7.2f}  (host clock {bw[name]['gbps_wall']:.2f})")
    ov = r.get("overlap", {})
    if "error" in ov:
        lines.append(f"  overlap: {ov['error']}")
    else:
        lines.append(f"  copy/compute overlap: copy alone {ov['copy_seconds'] * 1e3:.1f} ms, {ov['matmuls']} bf16 "
                     f"matmuls alone {ov['compute_seconds'] * 1e3:.1f} ms, both {ov['both_seconds'] * 1e3:.1f} ms: "
                     f"overlap ratio {ov['overlap_ratio']:.2f} (1.0 = perfect)")
    f = r.get("fp8", {})
    if "error" in f:
        lines.append(f"  fp8: {f['error']}")
    else:
        bf16 = f["bf16_tflops"]
        lines.append(f"  {f['shape']}: bf16 matmul "
                     + (f"{bf16['tflops']:.0f} TFLOPS" if "tflops" in bf16 else bf16.get("error", "?")))
        for key, label in (("scaled_mm", "torch._scaled_mm fp8"), ("scaled_mm_fast_accum", "  with fast accum")):
            if key not in f:
                continue
            s = f[key]
            if "tflops" in s:
                lines.append(f"    {label}: {s['tflops']:.0f} TFLOPS")
            else:
                lines.append(f"    {label}: {s.get('error') or s.get('skipped')}")
        if "speedup_vs_bf16" in f:
            lines.append(f"    fp8 / bf16 throughput: {f['speedup_vs_bf16']:.2f}x")
    a = r.get("attention", {})
    if "error" in a:
        lines.append(f"  attention: {a['error']}")
    elif a:
        lines.append(f"  attention {'x'.join(map(str, a['shape']))} (bf16, forward + backward, against "
                     f"{a['reference']}); default order: {a.get('default_order')}")
        for name, _, _ in ATTN_KERNELS:
            s = a.get(name, {})
            if "error" in s:
                lines.append(f"    {name:10s} {s['error'][:160]}")
            elif s:
                lines.append(f"    {name:10s} {'finite' if s['finite'] else 'NOT FINITE'}, largest relative error "
                             f"{s['max_rel_error']:.1e}, {s['ms_forward_backward']:.1f} ms")
    lines.append(f"  probe took {r.get('probe_seconds', 0):.1f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""``bench-swap``'s check that its settings trained the same losses (a fast but wrong path shows here)."""

from __future__ import annotations

import math
from typing import Any

COMPILED = "+compile"  # a setting's suffix: its blocks compiled (fp8c+compile:18)
# The fp8 settings and the memory keys each sets (with memory.fp8 = true): fp8 storage with
# optimum-quanto's dequantizing matmul, the fused dequantizing matmul, fp8 compute.
FP8_SETTINGS: dict[str, dict[str, bool]] = {
    "fp8": {"fp8_fused": False, "fp8_compute": False},
    "fp8f": {"fp8_fused": True, "fp8_compute": False},
    "fp8c": {"fp8_fused": False, "fp8_compute": True},
}


# Settings of one precision train the same math on the same weights, seeds and batches (swapping
# moves bytes, it does not change them), so their per-update losses must agree: to float32 rounding
# on fp32, and within bf16's resolution (8 bits of mantissa: 2**-8 relative) where the model runs
# under bf16 autocast -- on CUDA some kernels (attention backward) are not bitwise deterministic.
LOSS_RTOL = {"fp32": 1e-4, "default": 2**-8 * 2}
# fp8 compute against fp8 storage: each matmul adds e4m3's rounding of its input (about 2.6 % of a
# layer's output, tests/memory/test_fp8_compute.py); a tiny FLUX's losses stayed within 5 %.
FP8_COMPUTE_RTOL = 0.05
# fp8 storage against the bf16 weights it was made from: a different model by e4m3's rounding of every
# frozen weight (3 mantissa bits: up to 2**-4 relative per weight), not the same math; its losses
# are set against bf16:0's within the same 5 % as fp8 compute, to catch a path that computes wrongly,
# not to claim bf16's resolution.
FP8_STORAGE_RTOL = 0.05


def loss_agreement(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each precision with more than one finished setting: the largest relative difference of
    each setting's per-update losses from the first's, and whether it is within tolerance. fp8
    compute (fp8c) rounds activations and gradients to fp8 too: its losses are also set against fp8
    storage's at the same swap count, within FP8_COMPUTE_RTOL."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if r.get("status") == "ok" and r.get("losses"):
            groups.setdefault(r["setting"].split(":")[0], []).append(r)
    out = []
    for precision, rs in groups.items():
        rtol = _rtol(precision, rs[0])
        out += [_agreement(rs[0], r, rtol, f"tolerance {rtol:.1e}", "one of the two paths computes wrongly")
                for r in rs[1:]]
    fp8 = {r["setting"].split(":")[1]: r for r in groups.get("fp8", [])}
    # the fused dequantizing path rounds once per product where quanto rounds the weight: the same
    # math, so the same tolerance as among one precision's settings
    out += [_agreement(fp8[r["setting"].split(":")[1]], r, _rtol("fp8", r), f"tolerance {_rtol('fp8', r):.1e}",
                       "the fused dequantizing path computes differently")
            for r in groups.get("fp8f", []) if r["setting"].split(":")[1] in fp8]
    out += [_agreement(fp8[r["setting"].split(":")[1]], r, FP8_COMPUTE_RTOL,
                       f"fp8 compute's tolerance {FP8_COMPUTE_RTOL:.0e}", "fp8 compute strays from fp8 storage")
            for r in groups.get("fp8c", []) if r["setting"].split(":")[1] in fp8]
    # fp8 storage (each swap count) against the unswapped bf16 weights, when the bench has both
    bf16 = next((r for r in groups.get("bf16", []) if r["setting"].split(":")[1] == "0"), None)
    if bf16 is not None:
        out += [_agreement(bf16, r, FP8_STORAGE_RTOL, f"fp8 storage's tolerance {FP8_STORAGE_RTOL:.0e}",
                           "fp8 storage strays from the bf16 weights") for r in groups.get("fp8", [])]
    # Compiled blocks compute the same math as their eager setting (inductor rounds a little differently).
    eager = {r["setting"]: r for key, rs in groups.items() if not key.endswith(COMPILED) for r in rs}
    for key, rs in groups.items():
        for r in rs if key.endswith(COMPILED) else []:
            ref = eager.get(r["setting"].replace(COMPILED, ""))
            if ref is not None:
                rtol = _rtol(key, r)
                out.append(_agreement(ref, r, rtol, f"tolerance {rtol:.1e}", "compiled blocks compute differently"))
    return out


def _rtol(precision: str, r: dict[str, Any]) -> float:
    """The tolerance of a precision's settings among themselves (compiled or not): float32 rounding
    off CUDA, the model dtype's under CUDA autocast."""
    if r.get("device") != "cuda":
        return LOSS_RTOL["fp32"]
    return LOSS_RTOL.get(precision.removesuffix(COMPILED), LOSS_RTOL["default"])


def _agreement(ref: dict[str, Any], r: dict[str, Any], rtol: float, tolerance: str, differ: str) -> dict[str, Any]:
    pairs = list(zip(ref["losses"], r["losses"]))
    finite = all(math.isfinite(a) and math.isfinite(b) for a, b in pairs) and bool(pairs)
    diff = max((abs(a - b) / max(abs(a), 1e-12) for a, b in pairs), default=math.inf) if finite else math.inf
    ok = finite and diff <= rtol
    return {"reference": ref["setting"], "setting": r["setting"], "max_rel_diff": diff, "rtol": rtol, "agree": ok,
            "text": f"{r['setting']} vs {ref['setting']}: largest relative difference {diff:.2e} over "
                    f"{len(pairs)} updates ({tolerance}): {'agree' if ok else 'DIFFER: ' + differ}"}

"""`imglora plan`'s seconds per update against measured training updates on this CPU.

For each case and setting: the plan's prediction with ``--device cpu`` (the step's kernels from the
meta run, priced on this CPU as ``plan_time.calibrate_cpu`` measures it), then the same model built
as `imglora train` builds it (LoRA, fp8, block swap, AdamW, gradient checkpointing), and the median
of timed ``loop.step`` updates on one synthetic batch after warm-up updates. Cases: the tiny models
(overhead-bound: thousands of small ops) and real architectures shrunk in depth only (real widths:
products and weight traffic dominate), as ``benchmarks/plan_check.py`` builds them.

    python benchmarks/plan_time_check.py                # every case (about 10 minutes on 2 cores)
    python benchmarks/plan_time_check.py --cases tiny-flux,flux-1+1

Prints a Markdown table (predicted, measured, ratio, the prediction's parts) and writes
plan_time_check.json (``--out``). This checks the model of a step, with the CPU as the device whose
peaks are known; a GPU's prediction also rests on its datasheet peaks and assumed efficiencies,
which only a GPU run (``imglora bench-swap``, ``benchmarks/gpu_check.sh``) can check.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

# name: (preset, real-width changes or None for the tiny model, resolution, text length, settings)
CASES = {
    "tiny-flux": ("tiny-flux", None, 128, 0, [("model", 0), ("fp8", 0), ("fp8f", 0), ("fp8", 4)]),
    "tiny-sdxl": ("tiny-sdxl", None, 128, 0, [("model", 0), ("fp8", 0)]),
    "flux-1+1": ("tiny-flux", {"num_layers": 1, "num_single_layers": 2, "guidance_embeds": True}, 64, 16,
                 [("model", 0), ("fp8", 0), ("fp8f", 0), ("fp8", 2)]),
    "flux-1+1@256": ("tiny-flux", {"num_layers": 1, "num_single_layers": 2, "guidance_embeds": True}, 256, 64,
                     [("model", 0)]),
    "sdxl-111": ("tiny-sdxl", {"transformer_layers_per_block": [1, 1, 1]}, 128, 0, [("model", 0), ("fp8", 0)]),
}


def measure(cfg, family, src, precision: str, blocks: int, resolution: int, warmup: int, updates: int,
            real_width: bool) -> dict:
    import torch

    from imglora.training import step as loop
    from imglora.plan import predict as plan, timing as plan_time
    from imglora.models.tiny import random_init
    from imglora.family import Swappable, supports
    from imglora.memory.wrap import resolve_swap

    device = plan_time.calibrate_cpu()
    predicted = plan.predict(cfg, family, [plan.Setting(precision, blocks)], device_kind="cpu", src=src,
                             resolution=resolution, time_device=device).settings[0].predicted
    swapping = family.with_blocks_to_swap(cfg, blocks) if supports(family, Swappable) else cfg
    swap = resolve_swap(family, swapping, src)
    if real_width:
        trainable = family.meta_trainable(src, cfg, torch.float32)
        random_init(trainable.model, torch.float32)
        trainable.model.requires_grad_(False)
    else:
        trainable = family.load_trainable(src, cfg, torch.device("cpu"), torch.float32, swap)
    session = loop.build_session(swapping, family, trainable, loop.accelerator_for(cfg), swap=swap, total=100,
                                 out=lambda s: None)
    batch = family.synthetic_batch(trainable, resolution, cfg, torch.device("cpu"))
    loss_sum = torch.zeros(())
    times = []
    for i in range(warmup + updates):
        t = time.perf_counter()
        loop.step(session, loop.simple_micros([batch], torch.Generator().manual_seed(i)), loss_sum)
        times.append(time.perf_counter() - t)
    measured = statistics.median(times[warmup:])
    return {"setting": f"{precision}:{blocks}", "predicted": predicted.seconds, "measured": measured,
            "ratio": predicted.seconds / measured, "parts": predicted.parts, "kernels": predicted.kernels,
            "update_seconds": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--updates", type=int, default=7, help="timed updates per setting (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("plan_time_check.json"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from imglora.plan import timing as plan_time
    from imglora.commands.common import family_of, load_config
    from imglora.models.resolve import resolve_model
    from imglora.models.source import ModelSource
    from plan_check import config_dir

    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        sys.exit(f"--cases: unknown {', '.join(unknown)}; use some of {', '.join(CASES)}")
    dev = plan_time.calibrate_cpu()
    print(f"this CPU: {torch.get_num_threads()} threads, " + ", ".join(
        f"{k} {v * 1e3:.0f} GFLOPS" for k, v in dev.tflops.items()) +
        f", attention {dev.attention_eff[0] * dev.tflops['fp32'] * 1e3:.0f} GFLOPS, copies {dev.memory_gbs:.1f} GB/s, "
        f"{dev.host_op_s[0] * 1e6:.1f}/{dev.host_op_s[1] * 1e6:.1f} us per op forward/backward", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            preset, changes, resolution, text_len, settings = CASES[name]
            over = [f"data.resolution={resolution}"] + ([f"cache.text_max_length={text_len}"] if text_len else [])
            base = load_config(REPO / "presets" / f"{preset}.toml", over)
            family = family_of(base)
            if changes is None:
                src = resolve_model(base.model, family)
            else:
                part = "transformer" if base.model.family == "flux" else "unet"
                src = ModelSource(config_dir(base.model.family, part, changes, Path(tmp) / name))
            for precision, blocks in settings:
                cfg = base.replace(memory={"fp8": precision.startswith("fp8"), "fp8_fused": precision == "fp8f",
                                           "blocks_to_swap": blocks})
                r = measure(cfg, family, src, precision, blocks, resolution, args.warmup, args.updates,
                            changes is not None)
                r["case"] = name
                rows.append(r)
                print(f"{name} {r['setting']}: predicted {r['predicted']:.3f} s, measured {r['measured']:.3f} s, "
                      f"ratio {r['ratio']:.2f}", flush=True)
    args.out.write_text(json.dumps({"device": {"tflops": dev.tflops, "copy_gbs": dev.memory_gbs,
                                               "op_seconds": dev.host_op_s, "threads": torch.get_num_threads()},
                                    "rows": rows}, indent=1))
    print("\n| model | setting | predicted s/update | measured s/update | predicted / measured | "
          "products | attention | memory-bound | optimizer | per-op overhead | copies |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = r["parts"]
        print(f"| {r['case']} | {r['setting']} | {r['predicted']:.3f} | {r['measured']:.3f} | {r['ratio']:.2f} | "
              f"{p['products']:.3f} | {p['attention']:.3f} | {p['memory-bound']:.3f} | {p['optimizer']:.3f} | "
              f"{p['dispatch']:.3f} | {p['waiting for copies']:.3f} |")
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"\nlargest deviation: {100 * worst:.0f} %")


if __name__ == "__main__":
    main()

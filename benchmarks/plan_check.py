"""`imglora plan`'s prediction against the tensor bytes a real training step allocates, on real
architectures shrunk in depth only (real widths, so every layer and activation has its real size).

For each case: the plan (device cpu: fp32, no autocast) from the architecture on the meta device,
then the same model materialised with random weights on the CPU, LoRA + fp8 + block swap + AdamW
exactly as `imglora train` builds them, three updates under a tensor-allocation meter
(`imglora.plan.meter.LiveBytes`, plus what is allocated before it starts), and the ratio.

    python benchmarks/plan_check.py                 # FLUX 2+4 blocks, SDXL with 1 transformer layer per level
    python benchmarks/plan_check.py --quick         # FLUX 1+1 blocks only (the slow test runs this)

Prints a Markdown table and writes plan_check.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CASES = {
    # FLUX.1-dev's widths (3072, 24 heads x 128, T5 4096, CLIP 768), 2 double + 4 single blocks
    "flux-2+4": ("tiny-flux", "transformer", {"num_layers": 2, "num_single_layers": 4, "guidance_embeds": True},
                 128, 64, [("fp8", 0), ("fp8", 2), ("model", 0)]),
    "flux-1+1": ("tiny-flux", "transformer", {"num_layers": 1, "num_single_layers": 2, "guidance_embeds": True},
                 64, 16, [("fp8", 0), ("fp8", 2)]),
    # SDXL base 1.0's UNet widths (320/640/1280 channels, 2048 cross-attention), one transformer layer per level
    "sdxl-1,1,1": ("tiny-sdxl", "unet", {"transformer_layers_per_block": [1, 1, 1]}, 128, 0,
                   [("fp8", 0), ("model", 0)]),
}


def config_dir(family_name: str, part: str, changes: dict, dest: Path) -> Path:
    """A model folder holding only the configs: the real model's, with ``changes``."""
    import shutil

    from imglora.families import registry

    family = registry.get(family_name)
    shipped = Path(sys.modules[type(family).__module__].__file__).parent / "configs"
    src = shipped / ("flux1-dev" if family_name == "flux" else "sdxl-base-1.0")
    shutil.copytree(src, dest, dirs_exist_ok=True)
    cfg_file = dest / part / "config.json"
    config = json.loads(cfg_file.read_text())
    config.update(changes)
    cfg_file.write_text(json.dumps(config))
    return dest


def measure(cfg, family, src, precision: str, blocks: int) -> dict:
    import torch

    from imglora.training import step as loop
    from imglora.plan import predict as plan
    from imglora.models.tiny import random_init
    from imglora.family import Swappable, supports
    from imglora.memory.wrap import resolve_swap

    setting = plan.Setting(precision, blocks)
    t = time.perf_counter()
    predicted = plan.predict(cfg, family, [setting], device_kind="cpu", src=src).settings[0]
    plan_seconds = time.perf_counter() - t
    trainable = family.meta_trainable(src, cfg, torch.float32)
    random_init(trainable.model, torch.float32)
    trainable.model.requires_grad_(False)
    swapping = family.with_blocks_to_swap(cfg, blocks) if supports(family, Swappable) else cfg
    session = loop.build_session(swapping, family, trainable, loop.accelerator_for(cfg),
                                 swap=resolve_swap(family, swapping, model=trainable.model), total=10,
                                 out=lambda s: None)
    batch = family.synthetic_batch(trainable, cfg.data.resolution, cfg, torch.device("cpu"))
    t = time.perf_counter()
    peak = loop.measured_peak(session, batch)
    step_seconds = [round((time.perf_counter() - t) / 3, 2)]
    return {"setting": setting.name, "predicted": predicted.device_peak, "measured": peak,
            "ratio": predicted.device_peak / peak, "terms": {t.key: t.bytes for t in predicted.terms},
            "plan_seconds": round(plan_seconds, 2), "step_seconds": step_seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="FLUX 1+1 blocks only")
    ap.add_argument("--out", type=Path, default=Path("plan_check.json"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from imglora.commands.common import family_of, load_config
    from imglora.models.source import ModelSource

    names = ["flux-1+1"] if args.quick else ["flux-2+4", "sdxl-1,1,1"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            preset, part, changes, resolution, text_len, settings = CASES[name]
            base = load_config(REPO / "presets" / f"{preset}.toml", [f"data.resolution={resolution}"] +
                               ([f"cache.text_max_length={text_len}"] if text_len else []))
            family = family_of(base)
            src = ModelSource(config_dir(base.model.family, part, changes, Path(tmp) / name))
            for precision, blocks in settings:
                cfg = base.replace(memory={"fp8": precision == "fp8", "blocks_to_swap": blocks})
                r = measure(cfg, family, src, precision, blocks)
                r["case"] = name
                rows.append(r)
                print(f"{name} {r['setting']}: predicted {r['predicted'] / 2**20:.1f} MiB, measured "
                      f"{r['measured'] / 2**20:.1f} MiB, ratio {r['ratio']:.3f}", flush=True)
                torch.cuda.empty_cache() if torch.cuda.is_available() else None
    args.out.write_text(json.dumps(rows, indent=1))
    print("\n| architecture | setting | predicted MiB | measured MiB | predicted / measured |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['setting']} | {r['predicted'] / 2**20:.1f} | {r['measured'] / 2**20:.1f} | "
              f"{r['ratio']:.3f} |")
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"\nlargest deviation: {100 * worst:.1f} % ({'within' if worst <= 0.10 else 'OUTSIDE'} the 10 % target)")
    if worst > 0.10:
        sys.exit(1)


if __name__ == "__main__":
    main()

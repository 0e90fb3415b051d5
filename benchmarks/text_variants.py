"""What caption shuffling and caption dropout cost: K cached text variants per caption, against keeping
the text encoders loaded and encoding every step (what kohya sd-scripts does when shuffling).

Counted from the real models' shipped configs (SDXL base 1.0: CLIP-L + OpenCLIP bigG; FLUX.1-dev:
CLIP-L + T5-XXL), built on the meta device, so no download and no GPU:

- the encoders' parameters and their bf16 bytes (what stays on the device if they stay loaded);
- the bytes of one cached text entry (prompt_embeds + pooled_prompt_embeds at the family's token
  length, in bf16 as the cache holds them on CUDA), and what K variants of N captions take in host
  memory (imglora keeps the entries a run uses in host memory: a step copies the batch's to the GPU).

Then, measured on this machine with the tiny models: encoding the tiny-datasets preset's text
entries, and training updates with every entry cached (no encoder loaded).

    python benchmarks/text_variants.py [--captions 50,200,1000] [--k 8] [--steps 20]

Prints Markdown tables for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAMILIES = REPO / "src" / "imglora" / "families"
BF16 = 2


def encoder_params(folder: Path) -> int:
    import torch
    import transformers

    config = json.loads((folder / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    cfg = cls.config_class.from_pretrained(folder)
    with torch.device("meta"):
        model = cls(cfg)
    return sum(p.numel() for p in model.parameters())


def real_models() -> list[dict]:
    sdxl = FAMILIES / "sdxl" / "configs" / "sdxl-base-1.0"
    flux = FAMILIES / "flux" / "configs" / "flux1-dev"
    rows = []
    for name, folder, tokens, width, pooled in (
            ("SDXL (CLIP-L + bigG)", sdxl, 77, 768 + 1280, 1280),
            ("FLUX.1-dev (CLIP-L + T5-XXL)", flux, 512, 4096, 768)):
        params = sum(encoder_params(folder / part) for part in ("text_encoder", "text_encoder_2"))
        rows.append({"model": name, "encoder_params": params, "encoder_bytes": params * BF16,
                     "entry_bytes": (tokens * width + pooled) * BF16, "tokens": tokens})
    return rows


def tiny_run(steps: int) -> dict:
    """Encode the tiny-datasets preset's texts (a fresh cache), then train ``steps`` updates."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from imglora.commands.common import load_config
    from imglora.commands.train import train
    from imglora.data import cache
    from imglora.families import get_family
    from imglora.models.resolve import resolve_model

    tmp = Path(tempfile.mkdtemp(prefix="text-variants-"))
    try:
        os.chdir(REPO)
        overrides = [f"cache.dir={json.dumps(str(tmp / 'cache'))}", f"run.output_dir={json.dumps(str(tmp / 'runs'))}",
                     f"train.max_steps={steps}", "train.checkpoint_every=0", "train.log_every=1000"]
        cfg = load_config(REPO / "presets" / "tiny-datasets.toml", overrides)
        family = get_family(cfg.model.family)
        src = resolve_model(cfg.model.path, family)
        t0 = time.perf_counter()
        the_plan, stats = cache.fill_cache(cfg, family, src, "cpu", progress=False)
        fill = time.perf_counter() - t0
        lines: list[str] = []
        t0 = time.perf_counter()
        train(cfg, out=lines.append)
        loop = time.perf_counter() - t0
        done = next(x for x in lines if x.startswith("done:"))
        return {"texts": len(the_plan.texts), "texts_encoded": stats.texts_encoded, "fill_seconds": fill,
                "train_seconds": loop, "done": done,
                "data": next(x for x in lines if x.startswith("data:"))}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--captions", default="50,200,1000")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    captions = [int(x) for x in args.captions.split(",")]
    gib = 2**30
    print("| model | text encoders (params, bf16) | one cached entry | "
          + " | ".join(f"{n} captions x {args.k} variants" for n in captions) + " |")
    print("|---|---|---|" + "---|" * len(captions))
    for r in real_models():
        cells = [f"{n * args.k * r['entry_bytes'] / gib:.2f} GiB host" for n in captions]
        print(f"| {r['model']} | {r['encoder_params'] / 1e9:.2f} B, {r['encoder_bytes'] / gib:.2f} GiB device | "
              f"{r['entry_bytes'] / 2**20:.2f} MiB ({r['tokens']} tokens) | " + " | ".join(cells) + " |")
    sys.stdout.flush()
    t = tiny_run(args.steps)
    print(f"\ntiny-datasets on this machine: {t['texts']} text entries, {t['texts_encoded']} encoded in "
          f"{t['fill_seconds']:.2f} s (with the 20 latents); {args.steps} updates: {t['done']}\n{t['data']}")


if __name__ == "__main__":
    main()

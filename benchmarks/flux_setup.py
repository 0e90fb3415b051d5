"""Host memory and time of FLUX setup: the transformer read from a BFL file and quantized to fp8.

Measures, each in a fresh process, on a FLUX.1 architecture shrunk in depth only (blocks of the real
width, 3072, so one block weighs what it does in FLUX.1-dev; fewer of them):

- ``whole``: the file read into a full bf16 model, then quantized (what loading a whole model and
  quantizing it costs: the "bf16 copy of the whole model" peak);
- ``streamed``: read block by block, each block quantized as it is read, cache off;
- ``first``: the same with the quantized-model cache on (the first run writes the entry);
- ``cached``: the next run, reading the entry instead of the source.

For each: wall seconds, peak anonymous host memory (``RssAnon``, sampled every 5 ms: the memory a
process really holds; file pages of the memory-mapped source are reclaimable page cache), peak RSS
(``VmHWM``, file pages included), and the bytes that stay resident after setup. The prediction the
streamed phases are held to: peak anonymous memory above the baseline <= resident bytes + 2 blocks.

    python benchmarks/flux_setup.py --double 2 --single 4 --out bench-setup        # ~3 GB of disk
    python benchmarks/flux_setup.py --device cuda ...                               # on a GPU box

Writes ``setup.json`` and prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

PHASES = ("whole", "streamed", "first", "cached")


def status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class AnonPeak:
    """Peak RssAnon of this process, sampled on a thread (the kernel keeps no anonymous high-water mark)."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, status_kib("RssAnon") * 1024)
            time.sleep(self.interval)

    def __enter__(self) -> "AnonPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, status_kib("RssAnon") * 1024)


def write_model(folder: Path, double: int, single: int) -> None:
    """A BFL-layout transformer file with random bf16 weights and its diffusers config folder."""
    import torch
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    from imglora.families.flux.singlefile import flux_plan

    config = {"num_layers": double, "num_single_layers": single, "guidance_embeds": True}
    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
    (folder / "transformer").mkdir(parents=True, exist_ok=True)
    model.save_config(folder / "transformer")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    bfl: dict[str, list[int]] = {}
    for key, (src, rows, _) in flux_plan(dict(model.config)).items():
        shape = list(shapes[key])
        if rows is not None:
            shape[0] = max(bfl.get(src, [0])[0], rows[1])
        bfl[src] = shape
    g = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16) for k, s in bfl.items()}
    save_file(state, str(folder / "flux-shrunk.safetensors"))


def measure(phase: str, folder: Path, device: str) -> dict:
    """One phase, in this (fresh) process."""
    import torch

    from imglora.commands.common import load_config
    from imglora.families import registry
    from imglora.families._shared import stream
    from imglora.families.flux import singlefile
    from imglora.memory.swap import NO_SWAP
    from imglora.memory.fp8 import quantize_fp8, weight_bytes
    from imglora.models.source import ModelSource

    family = registry.get("flux")
    repo = Path(__file__).resolve().parents[1]
    cfg = load_config(repo / "presets" / "flux.toml", [
        f"cache.dir={json.dumps(str(folder / 'cache'))}", "memory.blocks_to_swap=0",
        f"cache.quantized_base={'false' if phase == 'streamed' else 'true'}"])
    src = ModelSource(folder, {"transformer": folder / "flux-shrunk.safetensors"})
    dev = torch.device(device)
    from imglora.runs.record import cached_sha256

    cached_sha256(src.files["transformer"])  # hashed once, outside the timing (remembered across runs)
    base = status_kib("RssAnon") * 1024
    t = time.perf_counter()
    with AnonPeak() as anon:
        if phase == "whole":
            model = singlefile.load_flux_transformer(src.files["transformer"], folder, dtype=torch.bfloat16)
            quantize_fp8(model, family.quantize_exclude)
            if dev.type == "cuda":
                from imglora.memory.fp8 import to_device

                to_device(model, dev)
            facts = {}
        else:
            model, facts = stream.load_transformer(src, cfg, torch.bfloat16, dev, NO_SWAP, family.quantize_exclude,
                                                   model_class="FluxTransformer2DModel",
                                                   file_reader=singlefile.load_flux_transformer,
                                                   blocks=singlefile.BLOCKS)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    blocks = [b for name in ("transformer_blocks", "single_transformer_blocks") for b in getattr(model, name)]
    block_bf16 = max(sum(p.numel() * 2 for p in b.parameters()) for b in blocks)
    return {"phase": phase, "seconds": round(seconds, 3), "baseline_anon": base, "peak_anon": anon.peak,
            "peak_rss": status_kib("VmHWM") * 1024, "resident": weight_bytes(model),
            "largest_block_bf16": block_bf16, "cache": facts.get("quantized_cache")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--double", type=int, default=2, help="double-stream blocks (FLUX.1-dev: 19)")
    ap.add_argument("--single", type=int, default=4, help="single-stream blocks (FLUX.1-dev: 38)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=Path("bench-setup"))
    ap.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # the child's side
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.phase:
        print(json.dumps(measure(args.phase, args.out, args.device)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.out / "flux-shrunk.safetensors").is_file():
        print(f"writing a FLUX.1 transformer with {args.double}+{args.single} blocks to {args.out} ...", flush=True)
        write_model(args.out, args.double, args.single)
    rows = []
    for phase in PHASES:
        proc = subprocess.run([sys.executable, __file__, "--phase", phase, "--device", args.device,
                               "--out", str(args.out)], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{phase} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{phase}: {rows[-1]['seconds']:.1f} s", flush=True)
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
           "device": args.device, "double": args.double, "single": args.single,
           "file_bytes": (args.out / "flux-shrunk.safetensors").stat().st_size}
    (args.out / "setup.json").write_text(json.dumps({"env": env, "phases": rows}, indent=1))
    gib = 2**30
    print(f"\nFLUX.1 shrunk to {args.double} double + {args.single} single blocks (width 3072), "
          f"file {env['file_bytes'] / gib:.2f} GiB bf16, device {args.device}\n")
    print("| phase | seconds | peak anon above baseline GiB | peak RSS GiB | resident after GiB | "
          "largest block bf16 GiB | predicted bound (resident + 2 blocks) GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        bound = r["resident"] + 2 * r["largest_block_bf16"]
        print(f"| {r['phase']} | {r['seconds']:.2f} | {(r['peak_anon'] - r['baseline_anon']) / gib:.2f} | "
              f"{r['peak_rss'] / gib:.2f} | {r['resident'] / gib:.2f} | {r['largest_block_bf16'] / gib:.2f} | "
              f"{bound / gib:.2f} |")
    for r in rows:
        if r["phase"] in ("streamed", "first"):
            ok = r["peak_anon"] - r["baseline_anon"] <= r["resident"] + 2 * r["largest_block_bf16"]
            print(f"{r['phase']}: peak within resident + 2 blocks: {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()

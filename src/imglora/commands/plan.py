"""``imglora plan`` and the memory check at the start of ``imglora train``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..util import atomic
from ..memory.wrap import preset_swap
from ..plan import predict as plan, budget as plan_budget
from ..errors import ImgloraError

if TYPE_CHECKING:
    from ..config import Config
    from ..models.source import ModelSource

SWEEP = (0, 9, 18, 27)  # kohya-style swap counts tried by default (as bench-swap's default sweep)


def source_or_shipped(cfg: "Config", family: Any) -> tuple["ModelSource | None", str | None]:
    """The model's source if it is on this machine; otherwise None and a note (the plan then uses the
    real model's config that imglora ships)."""
    from ..models.resolve import resolve_model

    try:
        return resolve_model(cfg.model, family), None
    except ImgloraError as exc:
        why = str(exc).splitlines()[0].split(". ")[0]
        return None, (f"{cfg.model.path} is not on this machine ({why}); planned from the architecture config "
                      f"imglora ships for the {family.name} family")


def default_settings(cfg: "Config", family: Any, src: "ModelSource | None", fp8_cores: bool = False) -> list[plan.Setting]:
    """The preset's own setting, then fp8 with the usual swap counts, the fused fp8 path and fp8
    compute (on a card with fp8 tensor cores) at the preset's swap count, then the model dtype
    unswapped."""
    from ..family import Swappable, supports

    layout = preset_swap(family, cfg, src)
    own = plan.own_setting(cfg, family, layout)
    out = [own]
    swaps: tuple[int, ...] = (0,)
    if supports(family, Swappable):
        swaps = tuple(n for n in SWEEP if plan_budget.valid_swap(family, list(layout.lengths), cfg, n))
    extra = [plan.Setting(p, own.blocks, own.counts) for p in ("fp8f", "fp8c") if p == "fp8f" or fp8_cores] \
        if own.blocks in swaps else []
    for s in [plan.Setting("fp8", n) for n in swaps] + extra + [plan.Setting("model", 0)]:
        if s not in out:
            out.append(s)
    return out


def parse_settings(text: str) -> list[plan.Setting]:
    from .bench import parse_settings as parse

    return [plan.Setting(s.precision, s.blocks) for s in parse(text, default_fp8=True)]


def run(preset: str, overrides: tuple[str, ...], *, blocks: str | None, resolution: int | None, vram: str | None,
        host_ram: str | None, bench_file: str | None, device: str, json_out: str | None,
        out: Callable[[str], None] = print, gpus: int = 1, gpu: str | None = None) -> plan.Plan:
    import psutil

    from ..plan import timing as plan_time

    from .bench import parse_size
    from .common import family_of, load_config

    cfg = load_config(preset, overrides)
    family = family_of(cfg)
    src, note = source_or_shipped(cfg, family)
    if device == "cuda":
        card = plan_time.gpu(gpu or "h200")
        if vram is None and gpu:
            vram = f"{card.vram_gib}GiB"
    elif gpu:
        raise ImgloraError("--gpu is for a CUDA plan; with --device cpu the seconds are this CPU's, as measured")
    else:
        card = plan_time.calibrate_cpu()
    settings = parse_settings(blocks) if blocks else default_settings(cfg, family, src, card.has_fp8)
    bench = None
    if bench_file:
        try:
            bench = json.loads(Path(bench_file).read_text())
        except (OSError, ValueError) as exc:
            raise ImgloraError(f"--bench {bench_file}: cannot read it as a bench-swap result ({exc})") from None
    vram_b, host_b = parse_size(vram, "--vram"), parse_size(host_ram, "--host-ram")
    p = plan.predict(cfg, family, settings, device_kind=device, src=src, resolution=resolution, vram=vram_b,
                     host_ram=host_b, bench=bench, process_rss=psutil.Process().memory_info().rss, processes=gpus,
                     time_device=card)
    if note:
        p.notes.append(note)
    p.notes.append("allocated tensor bytes, predicted from the architecture on the meta device and one "
                   "micro-batch's forward and backward run there (checked within 10 % of real CPU runs)")
    p.notes.append("not counted: filling the cache (`imglora cache-latents`), which loads the VAE and text "
                   "encoders once, before the model; run it first and training never loads them")
    if cfg.lora.text_encoder:
        kept = (f"; {', '.join(family.frozen_text_outputs)} of the frozen encoders stays cached"
                if family.frozen_text_outputs else "; no text output is cached")
        p.notes.append(f"lora.text_encoder: {' and '.join(family.text_encoder_parts)} train with the adapter, so their "
                       f"outputs can no longer be cached: they stay loaded and run in every update{kept}; their "
                       "weights (text_encoders), adapter, optimizer state and activations are counted above")
    p.notes.append(time_note(card, bool(bench)))
    if bench:
        compiled = [f"{r['setting']} {r['sec_per_update']['median']:.3f}" for r in bench.get("results", [])
                    if r.get("status") == "ok" and "+compile" in str(r.get("setting"))]
        if compiled:
            p.notes.append(f"measured with compiled blocks (memory.compile = \"blocks\"), s/update: {', '.join(compiled)}")
    if cfg.memory.attention_kernel != "auto":
        math = cfg.memory.attention_kernel == "math"
        p.notes.append(f"memory.attention_kernel = \"{cfg.memory.attention_kernel}\": planned as a fused attention "
                       "kernel" + (" (memory and time); the math kernel also holds each attention's full score "
                                   "matrices while it runs (heads x tokens^2 in fp32: about 2 GiB at 24 heads and "
                                   "4,608 tokens) and is several times slower, so the peak and the time are higher "
                                   "than shown: a setting for diagnosis, not for choosing a card" if math
                                   else ", as PyTorch's default choice is"))
    for sp in p.settings:
        if sp.time_note:
            p.notes.append(f"{sp.setting.name}: no time predicted: {sp.time_note}")
    if device == "cuda":
        p.notes.append("a card needs the peak x 1.05 (allocator rounding) + about 0.5 GiB (CUDA context); "
                       "host RAM counts this process as measured now, plus CUDA's libraries as estimated (2.5 GiB a "
                       "process, not yet measured on a GPU box) and page-locked buffers at their exact size "
                       "(registered; where registering fails, PyTorch's pinned allocator rounds each up to a power of two)")
    b = cfg.train.batch_size
    out(f"{family.name} at {p.resolution}x{p.resolution}, batch {b}, {cfg.lora.type} rank {cfg.lora.rank}, "
        f"{cfg.train.optimizer}, gradient checkpointing {'on' if cfg.memory.gradient_checkpointing else 'off'}, "
        f"for {'a CUDA machine (' + card.label + ')' if device == 'cuda' else 'this CPU'}" + (f" with {gpus} GPUs (data parallel; per GPU, host RAM for all):"
                                             if gpus > 1 else ":"))
    out("")
    out(plan.table(p, vram_b, host_b))
    out("")
    for n in p.notes:
        out(f"note: {n}")
    if vram_b or host_b:
        budget = " and ".join(x for x in (vram and f"{vram} of GPU memory", host_ram and f"{host_ram} of host RAM") if x)
        out(f"fastest setting that fits {budget}: {p.fastest_fit or 'none of these'}"
            + (" (by measured s/update where measured, else predicted)" if bench else " (by predicted s/update)"))
    if json_out:
        atomic.write_json(Path(json_out), p.to_dict())
        out(f"written: {json_out}")
    return p


def time_note(card: Any, bench: bool) -> str:
    """How the seconds per update were predicted, in a line."""
    if card.measured:
        rates = ", ".join(f"{k} products {v * 1e3:.0f} GFLOPS" for k, v in card.tflops.items())
        return (f"predicted s/update: the step's kernels (from the meta run) priced on this CPU as measured now: "
                f"{rates}, copies {card.memory_gbs:.1f} GB/s, {card.host_op_s[0] * 1e6:.1f} us per op; "
                "checked against measured steps in docs/benchmarks.md")
    peaks = ", ".join(f"{k} {v:g}" for k, v in card.tflops.items())
    return (f"predicted s/update on the {card.label}: the step's kernels (from the meta run) priced on datasheet "
            f"peaks (dense TFLOPS {peaks}; {card.memory_gbs:g} GB/s memory; {card.link_gbs:g} GB/s PCIe) at assumed "
            f"efficiencies (products {card.matmul_eff:.0%}, attention {card.attention_eff[0]:.0%}/"
            f"{card.attention_eff[1]:.0%} forward/backward, memory {card.memory_eff:.0%}, PCIe {card.link_eff:.0%}); "
            "a prediction, not a measurement" + ("" if bench else ": `imglora bench-swap` measures, and `--bench` "
                                                 "puts its figures in their place"))

"""imglora's own overhead: its training update against a bare diffusers + peft loop doing the same math.

Both sides live in one process and train the same model (loaded twice from the same folder), the
same LoRA modules (peft, the same target pattern, the bare side starting from imglora's initial
adapter weights), the same optimizer class and hyperparameters, the same clipping and the same
learning-rate schedule, on the same batches in the same order. They take turns: a round is ``U``
updates of one side then ``U`` of the other (the order flips every round), and the figure is the
median over rounds of (imglora seconds / bare seconds), so a machine that slows down for a while
slows both.

The imglora side runs what ``imglora train``'s loop runs per update: the update's seed, its
micro-batches from the trainer's batcher (collated from the cache, one random generator per
sample), ``loop.step`` and the non-finite check. The bare side is the loop of diffusers'
``train_text_to_image_lora_sdxl.py`` / ``train_dreambooth_lora_flux.py``: global-RNG noise,
``F.mse_loss``, ``loss.backward()``, ``clip_grad_norm_``, ``optimizer.step()``,
``lr_scheduler.step()``, ``zero_grad(set_to_none=True)``, with its batches built before timing
(the best a prefetching DataLoader could do).

``--shapes fixed`` uses only the updates whose batch is in the most common bucket (one shape);
``buckets`` uses the batcher's order (shapes change as training's do), and reports what the first
update at a shape costs over the median update at that shape, per side.

    python benchmarks/overhead.py                                  # tiny SDXL, sample data, fixed + buckets
    python benchmarks/overhead.py --preset presets/tiny-flux.toml  # FLUX, bf16 path (fp8 and swap off)
    python benchmarks/overhead.py --rounds 11 --updates 8 --out bench-overhead

Defaults follow the issue's measurement: ~128 px sample data, rank 8, attention LoRA (to_q, to_k,
to_v, to_out.0), fp32, 2 threads. Writes ``overhead.json`` and ``overhead.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULTS = ["lora.rank=8", 'train.mixed_precision="no"',  # (the bare loop runs without autocast, on a GPU too) "lora.alpha=8", 'model.dtype="fp32"',
            "train.checkpoint_every=0"]
FAMILY_DEFAULTS = {  # attention LoRA, and FLUX's bf16 path (no fp8, no swap)
    "sdxl": ['lora.targets=["to_q","to_k","to_v","to_out.0"]'],
    "flux": ['lora.targets=["attn.to_q","attn.to_k","attn.to_v","attn.to_out.0"]', "memory.fp8=false",
             "memory.blocks_to_swap=0", "memory.offload_checkpoints=false"]}


class Imglora:
    """What ``training._loop`` does per update, minus logging and checkpoints."""

    def __init__(self, cfg: Any, family: Any, src: Any, data: Any, batcher: Any, device: Any):
        import torch

        from imglora.util import devices
        from imglora.training import step as loop
        from imglora.memory.wrap import resolve_swap

        self.cfg, self.family, self.batcher, self.device = cfg, family, batcher, device
        accelerator = loop.accelerator_for(cfg)
        swap = resolve_swap(family, cfg, src)
        trainable = family.load_trainable(src, cfg, device, devices.weight_dtype(cfg, device), swap)
        self.session = loop.build_session(cfg, family, trainable, accelerator, swap=swap, total=10**6,
                                          out=lambda s: None)
        self.loss_sum = torch.zeros((), device=device)
        self.first_bad = torch.full((), -1, dtype=torch.long, device=device)  # (the loop's check: its cost counts)

    def update(self, step: int) -> None:
        import torch

        from imglora.training import step as loop, trainer as training
        from imglora.util import rng

        cfg = self.cfg
        rng.seed_global(loop.step_seed(cfg.train.seed, step))
        loop.step(self.session, training._micros(self.batcher, step, cfg.train.grad_accum, 0, 1, self.family,
                                                 cfg.train.seed, self.device), self.loss_sum)
        self.first_bad = torch.where((self.first_bad < 0) & ~torch.isfinite(self.loss_sum), step, self.first_bad)

    def mean_loss(self, updates: int) -> float:
        value = float(self.loss_sum) / max(1, updates)
        self.loss_sum.zero_()
        return value


class Bare:
    """The diffusers example scripts' loop on a second copy of the model (see the module docstring)."""

    def __init__(self, cfg: Any, family_name: str, src: Any, imglora: Imglora):
        import torch
        from peft import inject_adapter_in_model
        from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

        from imglora.util import devices
        from imglora.training import step as loop

        if src.files:
            sys.exit("overhead.py compares against diffusers' folder loading: point model.path at a diffusers folder")
        if cfg.train.grad_accum != 1 or cfg.lora.type != "lora":
            sys.exit("overhead.py's bare loop does plain LoRA with grad_accum 1")
        self.family, self.cfg = family_name, cfg
        dtype = devices.weight_dtype(cfg, imglora.device)
        s = imglora.session
        if family_name == "sdxl":
            from diffusers import DDPMScheduler, UNet2DConditionModel

            model = UNet2DConditionModel.from_pretrained(src.root, subfolder="unet", torch_dtype=dtype)
            self.noise_scheduler = DDPMScheduler.from_pretrained(src.root, subfolder="scheduler")
        elif family_name == "flux":
            from diffusers import FluxTransformer2DModel

            model = FluxTransformer2DModel.from_pretrained(src.root, subfolder="transformer", torch_dtype=dtype)
        else:
            sys.exit(f"overhead.py has a bare loop for sdxl and flux, not {family_name}")
        model.requires_grad_(False)
        if cfg.memory.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        inject_adapter_in_model(s.lora_config, model)
        set_peft_model_state_dict(model, get_peft_model_state_dict(s.model))  # the same initial adapter
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            p.data = p.data.float()
        model.to(imglora.device).train()
        self.model, self.device = model, imglora.device
        opt = s.optimizer.optimizer if hasattr(s.optimizer, "optimizer") else s.optimizer
        accepted = inspect.signature(type(opt)).parameters
        self.optimizer = type(opt)(self.params, **{k: v for k, v in opt.defaults.items() if k in accepted})
        self.lr_scheduler = loop.make_scheduler(cfg, self.optimizer, 10**6)
        self.batches: dict[int, dict[str, torch.Tensor]] = {}
        self.loss_sum = torch.zeros((), device=imglora.device)

    def prepare(self, batcher: Any, steps: list[int]) -> None:
        for step in steps:
            if step not in self.batches:
                self.batches[step] = batcher.batch(step - 1, self.device)

    def update(self, step: int) -> None:
        import torch

        loss = self.loss(self.batches[step])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.max_grad_norm or float("inf"))
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.loss_sum += loss.detach()

    def loss(self, batch: dict[str, Any]) -> Any:
        """The loss as the diffusers example scripts compute it, drawing from the global RNG."""
        latents = batch["latents"]
        dtype = self.model.dtype
        if self.family == "flux":
            target, pred = self._flux(batch, latents, dtype)
            return F().mse_loss(pred.float(), target.float())
        return self._sdxl(batch, latents, dtype)

    def _sdxl(self, batch: dict[str, Any], latents: Any, dtype: Any) -> Any:
        import torch

        settings, sched = self.cfg.family, self.noise_scheduler
        n = latents.shape[0]
        noise = torch.randn_like(latents)
        if settings.noise_offset:  # train_text_to_image_lora_sdxl.py --noise_offset
            noise += settings.noise_offset * torch.randn((n, latents.shape[1], 1, 1), device=latents.device)
        t = torch.randint(0, sched.config.num_train_timesteps, (n,), device=latents.device)
        noisy = sched.add_noise(latents, noise, t)
        target = noise if sched.config.prediction_type == "epsilon" else sched.get_velocity(latents, noise, t)
        pred = self.model(noisy.to(dtype), t, batch["prompt_embeds"].to(dtype),
                          added_cond_kwargs={"text_embeds": batch["pooled_prompt_embeds"].to(dtype),
                                             "time_ids": batch["time_ids"].to(dtype)}).sample
        if not settings.min_snr_gamma:
            return F().mse_loss(pred.float(), target.float())
        from diffusers.training_utils import compute_snr  # --snr_gamma

        snr = compute_snr(sched, t)
        weights = torch.stack([snr, settings.min_snr_gamma * torch.ones_like(t)], dim=1).min(dim=1)[0]
        weights = weights / snr if sched.config.prediction_type == "epsilon" else weights / (snr + 1)
        loss = F().mse_loss(pred.float(), target.float(), reduction="none")
        return (loss.mean(dim=list(range(1, loss.ndim))) * weights).mean()

    def _flux(self, batch: dict[str, Any], latents: Any, dtype: Any) -> tuple[Any, Any]:
        import torch

        from imglora.families.flux.model import image_ids, pack_latents

        settings = self.cfg.family
        if settings.resolution_dependent_shift or settings.loss_weighting != "none" or "loss_mask" in batch:
            sys.exit("overhead.py's bare FLUX loop has the plain loss only: set flux.resolution_dependent_shift = "
                     "false and flux.loss_weighting = \"none\", and use a dataset without masks")
        n, _, h, w = latents.shape
        x0 = pack_latents(latents)
        noise = torch.randn_like(x0)
        u = torch.sigmoid(settings.sigmoid_scale * torch.randn(n, device=latents.device))
        if settings.timestep_sampling == "shift":
            shift = settings.discrete_flow_shift
            sigma = u * shift / (1 + (shift - 1) * u)
        elif settings.timestep_sampling == "sigmoid":
            sigma = u
        else:
            sys.exit(f"overhead.py's bare FLUX loop draws timesteps as 'shift' or 'sigmoid', not "
                     f"{settings.timestep_sampling!r}")
        s = sigma.view(n, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        text = batch["prompt_embeds"]
        guidance = None
        if self.model.config.guidance_embeds:
            guidance = torch.full((n,), settings.guidance, device=latents.device, dtype=dtype)
        pred = self.model(hidden_states=noisy.to(dtype), timestep=sigma.to(dtype), guidance=guidance,
                          pooled_projections=batch["pooled_prompt_embeds"].to(dtype),
                          encoder_hidden_states=text.to(dtype),
                          txt_ids=torch.zeros(text.shape[1], 3, device=latents.device, dtype=dtype),
                          img_ids=image_ids(h, w, latents.device).to(dtype), return_dict=False)[0]
        return noise - x0, pred

    def mean_loss(self, updates: int) -> float:
        value = float(self.loss_sum) / max(1, updates)
        self.loss_sum.zero_()
        return value


def F() -> Any:
    import torch.nn.functional

    return torch.nn.functional


def check_same_math(imglora: Imglora, bare: Bare, batch: dict[str, Any], seed: int = 1234) -> dict[str, float]:
    """Both losses on one batch with the same draws (imglora's single-generator path draws in the
    order the diffusers scripts do): the bare loop must compute what imglora computes, or the
    timing compares different work. Both models hold the same weights, read from the same files;
    the relative tolerance, 1e-4, allows for fp32 kernels rounding differently on other memory."""
    import torch

    with torch.no_grad():
        generator = torch.Generator(device=imglora.device).manual_seed(seed)  # (draws as the global RNG's on that device)
        mine = float(imglora.session.trainable.loss(batch, generator))
        torch.manual_seed(seed)
        theirs = float(bare.loss(batch))
    rel = abs(mine - theirs) / max(abs(theirs), 1e-12)
    if not rel <= 1e-4:
        sys.exit(f"overhead.py: the bare loop's loss {theirs:.6g} differs from imglora's {mine:.6g} on the same batch "
                 f"and draws (relative {rel:.2g} > 1e-4): the comparison would time different math")
    return {"imglora_loss": mine, "bare_loss": theirs, "relative_difference": rel}

def shape_of(batcher: Any, step: int) -> tuple[int, int]:
    return batcher.samples[batcher.ref(step - 1).indices[0]].bucket


def choose_steps(batcher: Any, mode: str, count: int, start: int) -> list[int]:
    """``count`` update numbers from ``start`` on: all of them (buckets), or only those in the most
    common bucket of the first epochs (fixed)."""
    if mode == "buckets":
        return list(range(start, start + count))
    window = range(1, 1 + 4 * batcher.per_epoch)
    common = Counter(shape_of(batcher, s) for s in window).most_common(1)[0][0]
    steps, s = [], start
    while len(steps) < count:
        if shape_of(batcher, s) == common:
            steps.append(s)
        s += 1
    return steps


def timed(side: Any, steps: list[int], device: Any) -> list[float]:
    from imglora.util import devices

    times = []
    for step in steps:
        devices.synchronize(device)
        t = time.perf_counter()
        side.update(step)
        devices.synchronize(device)
        times.append(time.perf_counter() - t)
    return times


def shape_change_cost(times: list[float], shapes: list[tuple[int, int]]) -> dict[str, Any]:
    """Per shape: the median update and the first update at that shape after another shape, in seconds."""
    by_shape: dict[str, dict[str, list[float]]] = {}
    for i, (t, shape) in enumerate(zip(times, shapes)):
        kind = "after_change" if i and shapes[i - 1] != shape else "same"
        by_shape.setdefault(f"{shape[0]}x{shape[1]}", {"same": [], "after_change": []})[kind].append(t)
    out = {}
    for shape, d in sorted(by_shape.items()):
        same = statistics.median(d["same"]) if d["same"] else None
        change = statistics.median(d["after_change"]) if d["after_change"] else None
        out[shape] = {"updates": len(d["same"]) + len(d["after_change"]), "median_same_shape_s": same,
                      "median_after_change_s": change,
                      "change_over_same": change / same if same and change else None}
    return out


def run_mode(mode: str, imglora: Imglora, bare: Bare, batcher: Any, rounds: int, updates: int, warmup: int,
             device: Any, start: int) -> tuple[dict[str, Any], int]:
    steps_all = choose_steps(batcher, mode, warmup + rounds * updates, start)
    bare.prepare(batcher, steps_all)
    timed(imglora, steps_all[:warmup], device)
    timed(bare, steps_all[:warmup], device)
    imglora.mean_loss(1), bare.mean_loss(1)
    rows, im_all, bare_all = [], [], []
    for r in range(rounds):
        steps = steps_all[warmup + r * updates: warmup + (r + 1) * updates]
        order = (("imglora", imglora), ("bare", bare)) if r % 2 == 0 else (("bare", bare), ("imglora", imglora))
        seconds = {}
        for name, side in order:
            times = timed(side, steps, device)
            (im_all if name == "imglora" else bare_all).extend(times)
            seconds[name] = sum(times)
        rows.append({"round": r, "first": order[0][0], "imglora_s": seconds["imglora"], "bare_s": seconds["bare"],
                     "ratio": seconds["imglora"] / seconds["bare"],
                     "imglora_loss": imglora.mean_loss(updates), "bare_loss": bare.mean_loss(updates)})
    ratios = [row["ratio"] for row in rows]
    measured = steps_all[warmup:]
    result = {"mode": mode, "rounds": rows, "updates_per_round": updates, "warmup": warmup,
              "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
              "imglora_median_update_s": statistics.median(im_all), "bare_median_update_s": statistics.median(bare_all),
              "shapes": sorted({f"{a}x{b}" for a, b in (shape_of(batcher, s) for s in measured)})}
    if mode == "buckets":
        shapes = [shape_of(batcher, s) for s in measured]
        per_round = [shapes[r * updates:(r + 1) * updates] for r in range(rounds)]
        im_times = [im_all[r * updates:(r + 1) * updates] for r in range(rounds)]
        bare_times = [bare_all[r * updates:(r + 1) * updates] for r in range(rounds)]
        result["shape_change"] = {
            "imglora": shape_change_cost(sum(im_times, []), sum(per_round, [])),
            "bare": shape_change_cost(sum(bare_times, []), sum(per_round, []))}
    return result, steps_all[-1] + 1


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for m in report["modes"]:
        ax.plot([r["ratio"] for r in m["rounds"]], marker="o", label=f"{m['mode']} (median {m['ratio_median']:.3f})")
    ax.axhline(1.05, color="grey", linestyle="--", linewidth=1, label="target 1.05")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xlabel("round")
    ax.set_ylabel("imglora / bare seconds")
    ax.set_title(f"{report['family']}: imglora's update over a bare diffusers + peft loop")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=str(Path(__file__).resolve().parents[1] / "presets" / "tiny-sdxl.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override after the benchmark's defaults (repeatable)")
    parser.add_argument("--shapes", choices=("fixed", "buckets", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=61)
    parser.add_argument("--updates", type=int, default=1, help="updates per side per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-overhead"))
    args = parser.parse_args()

    import torch

    from imglora.util import devices
    from imglora.runs import record
    from imglora.commands.common import family_of, load_config
    from imglora.data.batches import Batcher
    from imglora.models.resolve import resolve_model

    torch.set_num_threads(args.threads)
    preset_family = load_config(args.preset).model.family
    cfg = load_config(args.preset, DEFAULTS + FAMILY_DEFAULTS.get(preset_family, []) + args.overrides)
    family = family_of(cfg)
    device = devices.default_device()
    src = resolve_model(cfg.model, family)
    data = family.prepare_data(cfg, src, device)
    batcher = Batcher(data.samples, cfg.train.batch_size, cfg.train.seed, collate=family.collate,
                      reg_ratio=cfg.data.reg_ratio)
    imglora = Imglora(cfg, family, src, data, batcher, device)
    bare = Bare(cfg, family.name, src, imglora)
    same = check_same_math(imglora, bare, batcher.batch(0, device))
    print(f"same math: loss on one batch with the same draws, imglora {same['imglora_loss']:.6f}, bare "
          f"{same['bare_loss']:.6f} (relative difference {same['relative_difference']:.1e})")
    report: dict[str, Any] = {"family": family.name, "preset": args.preset, "overrides": args.overrides,
                              "threads": args.threads, "device": device.type, "environment": record.environment(),
                              "lora_targets": sorted(imglora.session.lora_config.target_modules)
                              if isinstance(imglora.session.lora_config.target_modules, set)
                              else imglora.session.lora_config.target_modules,
                              "trainable_parameters": sum(p.numel() for p in imglora.session.params),
                              "gradient_checkpointing": cfg.memory.gradient_checkpointing, "same_math": same,
                              "modes": []}
    start = 1
    for mode in (("fixed", "buckets") if args.shapes == "both" else (args.shapes,)):
        result, start = run_mode(mode, imglora, bare, batcher, args.rounds, args.updates, args.warmup, device, start)
        report["modes"].append(result)
        print(f"{family.name} {mode:8s} ratio median {result['ratio_median']:.3f} "
              f"(min {result['ratio_min']:.3f}, max {result['ratio_max']:.3f}, {args.rounds} rounds); "
              f"median update imglora {result['imglora_median_update_s'] * 1000:.1f} ms, "
              f"bare {result['bare_median_update_s'] * 1000:.1f} ms; shapes {', '.join(result['shapes'])}")
        for side, shapes in result.get("shape_change", {}).items():
            for shape, d in shapes.items():
                if d["change_over_same"] is not None:
                    print(f"  {side:7s} {shape}: first update after a shape change {d['change_over_same']:.3f} x "
                          f"the median at that shape ({d['updates']} updates)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out / "overhead.png")
    print(f"wrote {args.out / 'overhead.json'} and {args.out / 'overhead.png'}")


if __name__ == "__main__":
    main()

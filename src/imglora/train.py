"""The training loop, shared by every family.

Setup (config → cache → model → LoRA → memory wrappers → optimizer), then a loop whose body is
the model's math and nothing else: the family computes the loss, every "N steps" block (log,
checkpoint) runs outside it. The loop never asks which family it trains.

Determinism: update ``s`` seeds the RNGs from (seed, s), and micro-batch ``m`` is a pure function
of (seed, m), so a resumed run repeats an uninterrupted one bit for bit on the same machine.
"""

from __future__ import annotations

import json
import math
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from . import atomic, checkpoint, economics, lora, record, runlock, telemetry
from .config import Config
from .data.batches import Batcher
from .errors import ImgloraError
from .families import get_family
from .memory.wrap import apply_memory, check_swap_counts
from .models import resolve_model

WARMUP_UPDATES = 3  # excluded from steady-state timing (allocator warm-up, first-call compilation)


class NonFiniteLoss(ImgloraError):
    pass


@dataclass
class TrainResult:
    run_dir: Path
    adapter: Path | None
    steps_done: int
    interrupted: bool
    record: Path
    signal: str | None = None
    eval_exit_code: int | None = None  # train.eval_after: the evaluation process's exit code


def step_seed(seed: int, step: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) % (2**63 - 1)


def weight_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """The frozen base weights' dtype: the preset's on a GPU, fp32 on the CPU (whose half-precision
    kernels are slow or missing)."""
    if device.type == "cpu":
        return torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.model.dtype]


def adapt(trainable: Any, family: Any, cfg: Config, device: torch.device,
          out: Callable[[str], None] = print) -> tuple[Any, Any]:
    """LoRA on the loaded model, then its memory features; the same for training, bench and eval.

    Returns the peft config and the memory setup (its ``before_forward`` runs before each forward).
    """
    lora_config = lora.inject(trainable.model, family, cfg.lora, cfg.train.seed)
    for p in lora.trainable_parameters(trainable.model):
        p.data = p.data.float()  # LoRA weights and their optimizer state train in fp32
    return lora_config, apply_memory(trainable.model, family, cfg.memory, device, out)  # fp8, swap, device


def make_optimizer(cfg: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    t = cfg.train
    if t.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                 weight_decay=t.weight_decay)
    if t.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=t.learning_rate, relative_step=False, scale_parameter=False, warmup_init=False,
                         weight_decay=t.weight_decay)
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ImgloraError("train.optimizer = \"adamw8bit\" needs bitsandbytes: `pip install bitsandbytes` "
                           "(CUDA only), or set train.optimizer = \"adamw\"") from None
    return bnb.optim.AdamW8bit(params, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                               weight_decay=t.weight_decay)


def make_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, total: int) -> Any:
    """diffusers' learning-rate schedules (as kohya sd-scripts uses them), by ``train.scheduler``;
    "constant" with warmup steps is diffusers' "constant_with_warmup"."""
    from diffusers.optimization import get_scheduler

    t = cfg.train
    name = "constant_with_warmup" if t.scheduler == "constant" and t.warmup_steps else t.scheduler
    return get_scheduler(name, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=total,
                         num_cycles=t.scheduler_cycles, power=t.scheduler_power)


def total_updates(cfg: Config, micro_per_epoch: int) -> int:
    if cfg.train.max_steps:
        return cfg.train.max_steps
    return max(1, math.ceil(cfg.train.epochs * micro_per_epoch / cfg.train.grad_accum))


class _StopFlag:
    """SIGTERM / Ctrl-C ask the loop to finish the current update, checkpoint and exit."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_StopFlag":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user really wants out
        self.signal = signum
        print(f"\n{signal.Signals(signum).name} received: finishing this update, then saving a checkpoint",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def train(cfg: Config, *, resume: bool = False, command: str = "", out: Callable[[str], None] = print) -> TrainResult:
    """Train ``cfg``'s adapter into its run folder (see the module docstring).

    ``command``: how this run was started, without ``--resume`` (``imglora train PRESET --set ...``);
    messages that say how to continue the run quote it. Default: ``imglora train <cfg.source>``.
    """
    command = command or f"imglora train {shlex.quote(cfg.source or '<preset>')}"
    # Checked before the run folder is touched: where the run and the cache will be written.
    atomic.check_writable(cfg.run.output_dir, "run.output_dir")
    atomic.check_writable(cfg.cache.dir, "cache.dir")
    with runlock.hold(cfg.run_dir, command + (" --resume" if resume else "")):
        for folder in (cfg.run_dir, cfg.run_dir / "checkpoints"):
            for line in atomic.recover(folder):  # only this process writes here now (the lock)
                out(f"cleanup: {line}")
        return _train(cfg, resume=resume, command=command, out=out)


def _train(cfg: Config, *, resume: bool, command: str, out: Callable[[str], None]) -> TrainResult:
    from accelerate import Accelerator

    run_dir = cfg.run_dir
    family = get_family(cfg.model.family)
    config_dict = cfg.to_dict()
    # Everything that can refuse the run is checked before any model is loaded (GPU time costs).
    resume_from = _resume_point(run_dir, config_dict) if resume else None
    if not resume:
        _refuse_existing_run(run_dir, command)
    _check_dependencies(cfg)
    with_model = resolve_model(cfg.model.path, cfg.model.family)
    check_swap_counts(family, with_model, cfg.memory)
    if resume_from is not None:
        _check_same_data(resume_from, family.data_version(cfg))
    mp = cfg.train.mixed_precision
    accelerator = Accelerator(mixed_precision=("no" if mp == "auto" and not torch.cuda.is_available()
                                               else "bf16" if mp == "auto" else mp))
    if accelerator.num_processes > 1:
        raise ImgloraError("multi-GPU training (accelerate launch with more than one process) is not supported "
                           "yet: run one process per GPU with different runs, or a single process")
    device = accelerator.device
    rec = record.RunRecord("train", run_dir, cfg.to_dict())
    t_setup = time.perf_counter()
    telemetry.reset_peaks(device)

    # -- setup: data first (encoders are loaded only for missing entries, then freed) ----------
    with rec.phase("resolve_model"):
        model_dir = with_model
    with rec.phase("cache"):
        data = family.prepare_data(cfg, model_dir, device)
    for w in data.warnings:
        out(f"warning: {w}")
    out(f"data: {data.summary}")

    with rec.phase("load_model"):
        trainable = family.load_trainable(model_dir, cfg, device, weight_dtype(cfg, device))
        model = trainable.model
        lora_config, memory = adapt(trainable, family, cfg, device, out)
        model.train()
        params = lora.trainable_parameters(model)
        optimizer = make_optimizer(cfg, params)
        batcher = Batcher(data.samples, cfg.train.batch_size, cfg.train.seed, collate=family.collate)
        total = total_updates(cfg, batcher.per_epoch)
        scheduler = make_scheduler(cfg, optimizer, total)
        # The swap engine places the model's tensors itself; accelerate must not move them again.
        model, optimizer = accelerator.prepare(model, optimizer, device_placement=[memory.swapper is None, True])
    n_params = sum(p.numel() for p in params)
    out(f"model: {family.name} from {model_dir}, LoRA rank {cfg.lora.rank} alpha {cfg.lora.alpha:g}, "
        f"{n_params:,} trainable parameters, device {device}, {total} updates")

    config_hash = cfg.hash()
    start = 0
    if resume_from is not None:
        start = _restore(resume_from, family, model, optimizer, scheduler, data.version, total, out)
    log_path = run_dir / "log.jsonl"
    history = _read_log(log_path, upto=start)

    def write_adapter(folder: Path) -> Path:
        return family.save_adapter(accelerator.unwrap_model(model), lora_config, folder)

    def save_checkpoint(step: int) -> Path:
        t0 = time.perf_counter()
        path = checkpoint.save(run_dir, step, write_adapter=write_adapter, optimizer=optimizer, scheduler=scheduler,
                               config=config_dict, config_hash=config_hash, keep=cfg.train.keep_checkpoints,
                               extra={"dataset_version": data.version, "total_updates": total})
        rec.data.setdefault("checkpoint_seconds", []).append(round(time.perf_counter() - t0, 4))
        return path

    with rec.phase("checksums"):  # hashed once per file and remembered (record.cached_sha256)
        rec.set(model_checksums=record.folder_checksums(model_dir))
    tb = _tensorboard(run_dir)
    _plotting()  # import matplotlib now: the end-of-run plot then costs the same as at projection time
    rec.set(setup_seconds=round(time.perf_counter() - t_setup, 3), model_dir=str(model_dir),
            dataset_version=data.version, dataset_items=len(data.samples),
            trainable_parameters=n_params, total_updates=total, resumed_from=start or None, memory=memory.facts)

    # -- the loop ------------------------------------------------------------------------------
    accum = cfg.train.grad_accum
    step_times: list[float] = []
    first_bad = torch.full((), -1, dtype=torch.long, device=device)  # first update with a non-finite loss
    loss_sum = torch.zeros((), device=device)
    last_log_t, last_log_step = time.perf_counter(), start
    paused = 0.0  # seconds since the last log spent saving checkpoints
    last_good_ckpt = start
    step = start
    interrupted = False
    stop_signal: str | None = None
    budget = cfg.train.budget
    projection: economics.Projection | None = None
    t_loop = time.perf_counter()
    with _StopFlag() as stop, rec.phase("train_loop"):
        for step in range(start + 1, total + 1):
            seed = step_seed(cfg.train.seed, step)
            torch.manual_seed(seed)  # LoRA dropout draws from the global RNG
            gen = torch.Generator(device=device).manual_seed(seed)
            for micro in range(accum):
                batch = batcher.batch((step - 1) * accum + micro, device)
                memory.before_forward()
                with accelerator.autocast():
                    loss = trainable.loss(batch, gen) / accum
                accelerator.backward(loss)
                loss_sum += loss.detach()
            if cfg.train.max_grad_norm:
                accelerator.clip_grad_norm_(params, cfg.train.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            # No .item() here: that would make the host wait for the device every update.
            first_bad = torch.where((first_bad < 0) & ~torch.isfinite(loss_sum), step, first_bad)

            if step % cfg.train.log_every == 0 or step == total or step - start == WARMUP_UPDATES or stop.signal:
                loss_value = loss_sum.item() / (step - last_log_step)  # a sync point, once per log
                loss_sum.zero_()
                now = time.perf_counter()
                # Checkpoint saves since the last log are not update time: the session formula has
                # its own term for them. (Periodic validation is, amortised.)
                per_update = (now - last_log_t - paused) / (step - last_log_step)
                paused = 0.0
                step_times += [per_update] * (step - last_log_step)
                last_log_t, last_log_step = now, step
                _check_finite(first_bad, run_dir, last_good_ckpt)
                mem = telemetry.memory(device)
                row = {"step": step, "loss": loss_value, "lr": scheduler.get_last_lr()[0],
                       "sec_per_update": per_update, "peak_allocated": mem["peak_allocated"],
                       "peak_reserved": mem["peak_reserved"], "rss": mem["rss"], "time": time.time()}
                history.append(row)
                _append_log(log_path, row)
                if tb:
                    tb.add_scalar("loss", loss_value, step)
                    tb.add_scalar("lr", row["lr"], step)
                out(_progress_line(step, total, row, step_times, device))
                if projection is None and len(step_times) >= WARMUP_UPDATES + budget.smoke_steps and step < total:
                    if not rec.data.get("checkpoint_seconds"):
                        # Measure what a checkpoint costs rather than guess it (and it is a safe point).
                        with rec.phase("checkpoints"):
                            save_checkpoint(step)
                        paused += rec.data["checkpoint_seconds"][-1]
                        last_good_ckpt = step
                    projection = _project(cfg, rec, step, total, step_times, t_setup)
                    out(projection.text(budget.currency))
                    if projection.over:
                        stop_signal = "budget"
            if data.validation and cfg.eval.every and (step % cfg.eval.every == 0 or step == total):
                val = validation_loss(trainable, data.validation, family.collate, device, memory, cfg.train.seed)
                history.append({"step": step, "val_loss": val, "time": time.time()})
                _append_log(log_path, history[-1])
                out(f"  validation loss at update {step}: {val:.4f} ({len(data.validation)} held-out examples)")
            if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0 and step not in (total, last_good_ckpt):
                _check_finite(first_bad, run_dir, last_good_ckpt)
                with rec.phase("checkpoints"):
                    save_checkpoint(step)
                paused += rec.data["checkpoint_seconds"][-1]
                last_good_ckpt = step
            if stop.signal or stop_signal == "budget":
                interrupted = True
                stop_signal = stop_signal or signal.Signals(stop.signal).name
                break
    loop_seconds = time.perf_counter() - t_loop

    # -- outputs -------------------------------------------------------------------------------
    t_finish = time.perf_counter()
    _check_finite(first_bad, run_dir, last_good_ckpt)
    with rec.phase("checkpoints"):
        if step == last_good_ckpt and step > start:  # already saved at this update
            ckpt_path = checkpoint.step_dir(run_dir, step)
        else:
            ckpt_path = save_checkpoint(step) if step > start or not checkpoint.list_checkpoints(run_dir) else None
    adapter = None
    if not interrupted:
        with atomic.atomic_dir(run_dir / "adapter") as tmp:
            adapter = run_dir / "adapter" / write_adapter(tmp).relative_to(tmp)
    _plot_loss(history, run_dir / "loss.png")
    if tb:
        tb.close()
    mem = telemetry.memory(device)
    rec.set(finish_seconds=round(time.perf_counter() - t_finish, 3))
    rec.set(steps_done=step, interrupted=interrupted, loop_seconds=round(loop_seconds, 3),
            sec_per_update=telemetry.steady_state(step_times, WARMUP_UPDATES), peak_memory=mem,
            final_loss=next((r["loss"] for r in reversed(history) if "loss" in r), None),
            final_val_loss=next((r["val_loss"] for r in reversed(history) if "val_loss" in r), None),
            adapter=str(adapter) if adapter else None,
            last_checkpoint=str(ckpt_path) if ckpt_path else None,
            lora={"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "targets": sorted(lora_config.target_modules)
                  if isinstance(lora_config.target_modules, set) else lora_config.target_modules})
    if projection:
        actual = time.perf_counter() - t_setup
        rec.set(projection={**projection.to_dict(), "actual_seconds": round(actual, 3),
                            "error_pct": round(100 * (projection.seconds - actual) / actual, 2)})
    rec.set(signal=stop_signal)
    rec_path = rec.write(status="interrupted" if interrupted else "ok")
    if stop_signal == "budget":
        assert projection is not None
        out(f"stopped by the budget guard at update {step}/{total}: the session would take "
            f"{projection.text(budget.currency)}; {projection.over}. Checkpoint {ckpt_path}.\n"
            f"To fit: set train.max_steps to {projection.fits_steps} or less, pick a faster swap setting "
            f"(`imglora bench-swap`), or a cheaper or faster GPU (`imglora estimate --offer`); then "
            f"`{command} --resume` continues from here.")
    elif interrupted:
        out(f"stopped at update {step}/{total}; checkpoint {ckpt_path}. Continue with: {command} --resume")
    else:
        ss = telemetry.steady_state(step_times, WARMUP_UPDATES)
        per = f"{ss['median']:.3f} s/update (median after {WARMUP_UPDATES} warm-up updates)" if ss["median"] else ""
        out(f"done: {step} updates in {telemetry.fmt_duration(loop_seconds)} {per}; adapter {adapter}")
    eval_code = None
    if cfg.train.eval_after and not interrupted:
        # Evaluate in a fresh process once this one has let go of the model, so sampling's memory
        # peak never stacks on training's (the record above holds training's peak only).
        del model, trainable, optimizer, scheduler, memory, params, batcher, data
        accelerator.free_memory()
        from .evaluate import run_subprocess

        eval_code = run_subprocess(run_dir, out)
    return TrainResult(run_dir, adapter, step, interrupted, rec_path, stop_signal, eval_code)


# ----------------------------------------------------------------------------------------------


def _project(cfg: Config, rec: record.RunRecord, step: int, total: int, step_times: list[float],
             t_setup: float) -> "economics.Projection":
    ckpt = rec.data.get("checkpoint_seconds") or []
    return economics.project(
        cfg.train.budget, step=step, total=total, elapsed=time.perf_counter() - t_setup,
        seconds_per_update=telemetry.steady_state(step_times, WARMUP_UPDATES)["mean"],
        checkpoint_every=cfg.train.checkpoint_every, seconds_per_checkpoint=sum(ckpt) / len(ckpt) if ckpt else 0.0)


@torch.no_grad()
def validation_loss(trainable: Any, samples: list[Any], collate: Callable, device: torch.device, memory: Any,
                    seed: int) -> float:
    """Mean loss over held-out samples with fixed noise per sample: comparable across updates and runs."""
    model = trainable.model
    was_training = model.training
    model.eval()  # no dropout
    total = 0.0
    for i, sample in enumerate(samples):
        batch = {k: v.to(device) for k, v in collate([sample.variants[0]]).items()}
        memory.before_forward()
        total += float(trainable.loss(batch, torch.Generator(device=device).manual_seed(seed + 7919 * i)))
    model.train(was_training)
    return total / len(samples)


def _refuse_existing_run(run_dir: Path, command: str) -> None:
    """A new run never writes over an earlier one's checkpoints, log or adapter."""
    ckpts = checkpoint.list_checkpoints(run_dir)
    if ckpts or (run_dir / "adapter").exists():
        newest = f" (newest checkpoint: update {ckpts[-1][0]})" if ckpts else ""
        raise ImgloraError(
            f"{run_dir} already holds a run{newest}. Continue it with `{command} --resume`, or start a new one "
            "under another name: --set run.name=<new name>")


def _check_dependencies(cfg: Config) -> None:
    """Settings that need bitsandbytes (and CUDA) fail before any model is loaded."""
    needs = [(cfg.train.optimizer == "adamw8bit", 'train.optimizer = "adamw8bit"', 'train.optimizer = "adamw"'),
             (cfg.memory.quantization == "nf4", 'memory.quantization = "nf4"', 'memory.quantization = "qint4"')]
    for wanted, setting, instead in needs:
        if not wanted:
            continue
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise ImgloraError(f"{setting} needs bitsandbytes: `pip install bitsandbytes` (CUDA only), or set "
                               f"{instead}") from None
        if not torch.cuda.is_available():
            raise ImgloraError(f"{setting} needs a CUDA GPU; on this machine set {instead}")


def _resume_point(run_dir: Path, config_dict: dict[str, Any]) -> dict[str, Any]:
    """The newest readable checkpoint whose settings match; a broken one is reported and skipped."""
    ckpts = checkpoint.list_checkpoints(run_dir)
    if not ckpts:
        raise checkpoint.ResumeRefused(f"--resume: {run_dir}/checkpoints holds no checkpoint; start without --resume")
    broken = []
    for step, path in reversed(ckpts):
        try:
            state = checkpoint.load(path)
        except checkpoint.UNREADABLE as exc:  # a checkpoint damaged by a crash or a full disk
            broken.append(f"{path}: {exc}")
            continue
        diffs = checkpoint.config_differences(state["config"], config_dict)
        if diffs:
            raise checkpoint.ResumeRefused(
                f"--resume refused: {path} was trained with different settings that change the result:\n  "
                + "\n  ".join(diffs) + "\nRestore them, or start a new run (another run.name).")
        state["step"], state["path"], state["skipped"] = step, path, broken
        return state
    raise checkpoint.ResumeRefused("--resume: no readable checkpoint:\n  " + "\n  ".join(broken))


def _restore(state: dict[str, Any], family: Any, model: Any, optimizer: Any, scheduler: Any, data_version: str,
             total: int, out: Callable[[str], None]) -> int:
    for problem in state["skipped"]:
        out(f"warning: skipped a damaged checkpoint: {problem}")
    path = state["path"]
    _check_same_data(state, data_version)
    if state.get("total_updates") not in (None, total):
        raise checkpoint.ResumeRefused(f"--resume refused: {path} belongs to a run of {state['total_updates']} "
                                       f"updates, this one would have {total}")
    lora.load_adapter_state(_unwrap(model), family.read_adapter(state["adapter_dir"]))
    optimizer.load_state_dict(state["optimizer_state"])
    scheduler.load_state_dict(state["scheduler"])
    out(f"resuming from {path} (update {state['step']})")
    return state["step"]


def _check_same_data(state: dict[str, Any], data_version: str) -> None:
    if state.get("dataset_version") not in (None, data_version):
        raise checkpoint.ResumeRefused(
            f"--resume refused: the dataset changed since {state['path']} (dataset version "
            f"{state['dataset_version'][:12]} then, {data_version[:12]} now): images, captions or repeats differ, so "
            "the run would not continue the same training. Restore the data, or start a new run (another run.name).")


def _unwrap(model: Any) -> Any:
    return getattr(model, "module", model)


def _check_finite(first_bad: torch.Tensor, run_dir: Path, last_good: int) -> None:
    bad = int(first_bad.item())
    if bad >= 0:
        kept = (f"the last good checkpoint (update {last_good}) is kept in {run_dir / 'checkpoints'}"
                if last_good else "no checkpoint had been written yet")
        raise NonFiniteLoss(
            f"the loss became NaN or infinite at update {bad}; stopping before anything is saved. Likely causes: "
            "learning rate too high (try half), fp16 overflow (use bf16), a corrupt cache entry "
            f"(`imglora cache-latents --verify`), or min_snr/noise settings out of range. {kept}.")


def _progress_line(step: int, total: int, row: dict[str, Any], times: list[float], device: torch.device) -> str:
    recent = times[-20:]
    per = sorted(recent)[len(recent) // 2] if recent else row["sec_per_update"]
    eta = telemetry.fmt_duration(per * (total - step))
    width = 20
    filled = int(width * step / total)
    mem = (f" | peak {telemetry.gib(row['peak_allocated'])} alloc, {telemetry.gib(row['peak_reserved'])} reserved"
           if device.type == "cuda" else "")
    return (f"[{'#' * filled}{'.' * (width - filled)}] {step}/{total} | loss {row['loss']:.4f} | "
            f"{row['sec_per_update']:.2f} s/update | ETA {eta}{mem} | RSS {row['rss'] / 2**30:.2f} GiB")


def _append_log(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


def _read_log(path: Path, upto: int) -> list[dict[str, Any]]:
    """Rows up to the resumed update; later rows (from the interrupted attempt) are dropped."""
    if not path.exists():
        return []
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:  # e.g. the last line of a run killed mid-write
            print(f"warning: {path}:{n} is not a JSON line; dropped", file=sys.stderr)
            continue
        if row is not None and row.get("step", 0) <= upto:
            rows.append(row)
    atomic.write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _tensorboard(run_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


def _plotting() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_loss(history: list[dict[str, Any]], path: Path) -> None:
    if not history:
        return
    plt = _plotting()

    rows = [r for r in history if "loss" in r]
    steps = [r["step"] for r in rows]
    losses = [r["loss"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, losses, lw=1, alpha=0.5, label="training loss")
    k = max(1, len(losses) // 10)
    if len(losses) > k > 1:
        smooth = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(steps, smooth, lw=2, label=f"moving mean ({k})")
    val = [r for r in history if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", lw=2, label="validation loss")
    ax.set_xlabel("optimizer update")
    ax.set_ylabel("loss")
    ax.set_title(path.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic.atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


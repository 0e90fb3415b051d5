"""The training loop, shared by every family.

Setup (config → cache → model → LoRA → memory wrappers → optimizer), then a loop whose body is one
optimizer update (``loop.step``: the model's math and nothing else) and the "every N updates"
blocks (log, validation, checkpoint), which run outside it. The loop never asks which family it
trains.

Determinism: update ``s`` seeds the RNGs from (seed, s), and micro-batch ``m`` is a pure function of
(seed, m), so a resumed run repeats an uninterrupted one bit for bit on the same machine.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from safetensors.torch import save_file

from ..util import atomic, devices, distributed, rng
from . import checkpoint, step as loop, oom, optimizers, resume, runlock
from ..runs import cost as economics, record, log as runlog, telemetry, trackers
from ..plan import budget as plan_budget
from ..adapters import preservation
from ..data.batches import Batcher
from ..util.rng import SampleRNG, sample_seed
from ..errors import ImgloraError
from .interrupt import Abandoned, saving
from .interrupt import StopFlag as _StopFlag
from ..memory.wrap import resolve_swap
from ..models.resolve import resolve_model
from ..family import option

if TYPE_CHECKING:
    from ..config import Config
    from ..family import Family

WARMUP_UPDATES = economics.WARMUP_UPDATES  # excluded from steady-state timing


class NonFiniteLoss(ImgloraError):
    pass


def adapted_module(parameter: str) -> str:
    """The layer an adapter parameter belongs to: ``blocks.0.attn.to_q.lora_A.default.weight`` ->
    ``blocks.0.attn.to_q`` (peft's LoRA, LoHa, LoKr and OFT names)."""
    parameter = parameter.split(":", 1)[-1]
    for mark in (".lora_", ".hada_", ".lokr_", ".oft_"):
        if mark in parameter:
            return parameter[:parameter.index(mark)]
    return parameter.rsplit(".", 1)[0]


@dataclass
class TrainResult:
    run_dir: Path
    adapter: Path | None
    steps_done: int
    interrupted: bool
    record: Path | None  # None in the processes other than the main one (which writes it)
    signal: str | None = None
    eval_exit_code: int | None = None  # train.eval_after: the evaluation process's exit code


def train(cfg: "Config", family: "Family", families: Any, *, resume_run: bool, command: str,
          out: Callable[[str], None]) -> TrainResult:
    """Train ``cfg``'s adapter into its run folder. ``families`` is the catalog the config came from
    (a checkpoint's saved config is read with it); ``command`` is how the run was started, quoted in
    messages that say how to continue it."""
    run_dir = cfg.run_dir
    # Everything that can refuse the run is checked before any model is loaded (GPU time costs).
    resume_from = resume.resume_point(run_dir, cfg, families) if resume_run else None
    if not resume_run and distributed.rank_from_env() == 0:  # (the main process speaks for the run folder)
        resume.refuse_existing_run(run_dir, command)
    resume.check_dependencies(cfg)
    src = resolve_model(cfg.model, family)
    swap = resolve_swap(family, cfg, src)  # the blocks kept on the host, once: refused now if the model can't
    if resume_from is not None:
        resume.check_same_data(resume_from, family.data_version(cfg))
    # Trackers write from the main process only (one wandb run id, one TensorBoard folder).
    accelerator = loop.accelerator_for(cfg, trackers.for_run(cfg, run_dir) if distributed.rank_from_env() == 0 else None)
    procs, rank, main = accelerator.num_processes, accelerator.process_index, accelerator.is_main_process
    if resume_from is not None:
        resume.check_processes(resume_from, procs, command)
    if not main:
        out = _quiet  # one voice: the main process prints, logs and writes
    device = accelerator.device
    if cfg.memory.compile != "none":
        from ..memory.compile import require_toolchain

        require_toolchain(device)  # before the cache is filled and the model loaded
    memory_plan = plan_budget.check_at_start(cfg, family, src, swap, device.type, out)  # refuses before loading when it cannot fit
    rec = record.RunRecord("train", run_dir, cfg.to_dict())
    rec.main = main  # only the main process writes the record
    t_setup = time.perf_counter()
    telemetry.reset_peaks(device)
    stages = oom.Stages()  # an out-of-memory error is reported with the stage it happened in
    run: _Run | None = None
    with oom.guard(stages, rec, device, lambda: memory_plan, lambda: run and run.last_checkpoint_path()):

        # -- setup: data first (encoders are loaded only for missing entries, then freed) ------
        with rec.phase("cache"), stages("caching"), accelerator.main_process_first():
            data = family.prepare_data(cfg, src, device)  # filled once, by the main process; then read
        # Encodings over all processes: the main one fills the cache, the others only read it.
        encoded = int(distributed.sum_all(torch.tensor(data.encoded, device=device)).item()) if procs > 1 else data.encoded
        rec.set(cache_encoded=encoded)
        for w in [*data.warnings, *filter(None, [optimizers.note(cfg)])]:
            out(f"warning: {w}")
        out(f"data: {data.summary}")
        with rec.phase("load_model"):
            with stages("loading"):
                trainable = preservation.wrap(family.load_trainable(src, cfg, device, devices.weight_dtype(cfg, device), swap), cfg)
            # One deterministic order of global batches; each process takes its share of every one.
            batcher = Batcher(data.samples, cfg.train.batch_size * procs, cfg.train.seed, collate=family.collate,
                              reg_ratio=cfg.data.reg_ratio)
            total = loop.total_updates(cfg, batcher.per_epoch)
            with stages("quantizing"):
                session = loop.build_session(cfg, family, trainable, accelerator, swap=swap, total=total, out=out)
        n_params = sum(p.numel() for p in session.params)
        effective = cfg.train.batch_size * cfg.train.grad_accum * procs
        out(f"model: {family.name} from {src}, LoRA rank {cfg.lora.rank} alpha {cfg.lora.alpha:g}, "
            f"{n_params:,} trainable parameters, device {device}, {total} updates")
        if procs > 1:
            out(f"data parallel: {procs} processes; effective batch {effective} = batch {cfg.train.batch_size} x "
                f"accumulation {cfg.train.grad_accum} x {procs} processes")
        start = resume.restore(resume_from, family, session, data.version, total, out) if resume_from else 0
        run = _Run(cfg, family, session, rec, data, total, start, t_setup, out, stages)
        with rec.phase("checksums"):  # hashed once per file and remembered (record.cached_sha256)
            rec.set(model_checksums=src.checksums())
        runlog.plotting()  # import matplotlib now: the end-of-run plot then costs the same as at projection time
        rec.set(setup_seconds=round(time.perf_counter() - t_setup, 3), model_dir=str(src.root),
                model_source=src.to_record(), model_facts=trainable.facts,
                dataset_version=data.version, dataset_items=len(data.samples), dataset_sets=data.sets or None,
                trainable_parameters=n_params,
                total_updates=total, resumed_from=start or None, memory=session.memory.facts,
                memory_plan=memory_plan, processes=procs, effective_batch=effective)
        # Set-up (caching, loading, quantizing, placing) has its own peak; the loop's is measured apart,
        # as `imglora plan` predicts it.
        devices.synchronize(device)
        rec.set(setup_peak_memory=telemetry.memory(device))
        telemetry.reset_peaks(device)

        # -- the loop --------------------------------------------------------------------------
        t_loop = time.perf_counter()
        stages.detail = lambda: oom.step_stage(session.stage, run.step == start + 1)
        with _StopFlag(run.last_checkpoint_path, speak=main) as stop:
            run.stop_flag = stop
            try:
                with rec.phase("train_loop"), stages("training"), distributed.peers_guard(procs, run):
                    _loop(run, stop, batcher, rank, procs, device)
            except Abandoned:  # a second Ctrl-C during an update: that update is not saved
                return run.abandon(command)
            stop.saving = True  # only saving is left: from here on a Ctrl-C never abandons it
            return run.finish(run.step, time.perf_counter() - t_loop, command)


def _loop(run: "_Run", stop: "_StopFlag", batcher: Batcher, rank: int, procs: int, device: torch.device) -> None:
    """The updates from the start until the last or a stop; ``run.step`` is the one under way."""
    cfg, session, data, family, accum, total = run.cfg, run.s, run.data, run.family, run.cfg.train.grad_accum, run.total
    for step in range(run.start + 1, total + 1):
        run.step = step
        rng.seed_global(loop.step_seed(cfg.train.seed, step))  # LoRA dropout draws from the global RNG
        loop.step(session, _micros(batcher, step, accum, rank, procs, family, cfg.train.seed, device), run.loss_sum)
        run.note_skip(step)  # a non-finite gradient skipped the update: logged; too many in a row stop the run
        run.note_non_finite(step)  # a non-finite loss under finite gradients, on the device: no wait for it
        if session.ema is not None and not session.skipped and step % cfg.train.ema_every == 0:
            session.ema.update(session.params)
        # Several processes decide on the signal they agreed on: one that arrives after the exchange
        # waits for the next update (acted on at once by one process, the others would wait for it
        # in a collective it never joins).
        signalled = run.agree(stop) if procs > 1 else stop.signal
        if step % cfg.train.log_every == 0 or step == total or step - run.start == WARMUP_UPDATES or signalled:
            run.log(step)  # a sync point, once per log
        if data.validation and cfg.eval.every and (step % cfg.eval.every == 0 or step == total):
            run.validate(step)
        if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0 and step not in (
                total, run.last_good_ckpt):
            run.checkpoint(step)
        if signalled or run.stop_signal == "budget":
            run.stop_signal = run.stop_signal or signal.Signals(signalled).name
            break


def _micros(batcher: Batcher, step: int, accum: int, rank: int, procs: int, family: "Family", seed: int,
            device: torch.device) -> Iterator[loop.Micro]:
    """Update ``step``'s micro-batches as this process sees them: its share of each global batch, a
    generator per sample (seeded by the sample's place in the update, so how the batch is cut between
    processes does not change its draws), and its share of the loss."""
    for k, i in enumerate(range((step - 1) * accum, step * accum)):
        part = batcher.part(i, device, rank, procs, option(family, "loss_units"))
        seeds = [sample_seed(seed, step, k * batcher.batch_size + j) for j in part.positions]
        yield loop.Micro(part.batch, SampleRNG(seeds, device), part.scale)


def _quiet(_: str) -> None:
    pass


class _Run:
    """What the "every N updates" blocks share: the log, timing, checkpoints, the budget projection."""

    def __init__(self, cfg: "Config", family: "Family", session: loop.Session, rec: record.RunRecord, data: Any,
                 total: int, start: int, t_setup: float, out: Callable[[str], None], stages: oom.Stages):
        self.cfg, self.family, self.s, self.rec, self.data, self.stages = cfg, family, session, rec, data, stages
        self.procs, self.main = session.accelerator.num_processes, session.accelerator.is_main_process
        self.budget_pending = False  # several processes: the main one's budget verdict, until agreed
        self.total, self.start, self.t_setup, self.out = total, start, t_setup, out
        self.run_dir, self.device = cfg.run_dir, session.device
        self.config_hash, self.config_dict = cfg.hash(), cfg.to_dict()
        self.log_path = self.run_dir / "log.jsonl"
        self.history = runlog.read(self.log_path, upto=start)
        self.watch = runlog.DivergenceWatch()  # (fed the resumed rows too: the lowest loss so far counts)
        for row in self.history:
            if "loss" in row:
                self.watch.add(row["step"], row["loss"])
        self.trackers = trackers.start(session.accelerator, cfg, "train") if self.main else None
        self.offer, self.rate, self.budget = economics.run_rate(cfg)  # run.offer / train.budget.hourly_rate
        self.step_times: list[float] = []
        self.first_bad = torch.full((), -1, dtype=torch.long, device=self.device)  # first non-finite update
        self.skipped: list[int] = []  # updates skipped for a non-finite gradient (train.max_skipped_updates)
        self.skipped_in_row = self.skipped_since_log = 0
        self.loss_sum = torch.zeros((), device=self.device)
        self.last_log_t, self.last_log_step = time.perf_counter(), start
        self.paused = 0.0  # seconds since the last log spent saving checkpoints
        self.last_good_ckpt = start
        self.step = start  # the update under way (the last one done once the loop ends)
        self.stop_flag: _StopFlag | None = None  # (a save under way is not abandoned by a second Ctrl-C)
        self.stop_signal: str | None = None
        self.projection: economics.Projection | None = None

    def note_non_finite(self, step: int) -> None:  # a counted update's loss (its gradients were finite)
        self.first_bad = torch.where((self.first_bad < 0) & ~torch.isfinite(self.loss_sum), step, self.first_bad)

    def note_skip(self, step: int) -> None:
        """``loop.step`` skipped this update (a gradient was NaN or infinite; the weights, the optimizer,
        the schedule and the EMA are as before it): a log row and a warning say so. More than
        train.max_skipped_updates in a row stop the run, with a checkpoint of those unchanged weights."""
        if not self.s.skipped:
            self.skipped_in_row = 0
            return
        self.skipped.append(step)
        self.skipped_in_row += 1
        self.skipped_since_log += 1
        bad, limit = self.s.bad_gradient, self.cfg.train.max_skipped_updates
        where = f"first non-finite gradient: {bad} (module {adapted_module(bad)})" if bad else "gradient norm not finite"
        row = {"step": step, "skipped": "gradient not finite", "grad_norm": str(float(self.s.grad_norm)),
               "nonfinite_gradient": bad, "skipped_in_row": self.skipped_in_row, "time": time.time()}
        self.history.append(row)
        if self.main:
            runlog.append(self.log_path, row)
        self.out(f"warning: update {step} skipped, nothing applied ({where}); {self.skipped_in_row} in a row, "
                 f"the run stops after {limit} (train.max_skipped_updates)")
        if self.skipped_in_row <= limit:
            return
        saved = self.checkpoint(step)  # the weights are those before the skipped updates: finite
        raise NonFiniteLoss(
            f"{self.skipped_in_row} updates in a row (up to update {step}) had NaN or infinite gradients and were "
            f"skipped (train.max_skipped_updates = {limit}); {where}. Nothing non-finite reached the weights: a "
            f"checkpoint of them is saved in {saved}. Likely causes: an attention kernel that is broken on this "
            "GPU (resume with --set memory.attention_kernel=\"math\" to tell), a learning rate too high (try half), "
            "fp16 overflow (use bf16), a corrupt cache entry (`imglora cache-latents --verify`), or min_snr/noise "
            "settings out of range.")

    def agree(self, stop: "_StopFlag") -> int:
        """Several processes: share what any of them saw -- the first non-finite update, a signal,
        the budget guard's verdict -- so all stop at the same update (one collective per update).
        Returns the signal agreed on (0: none), which the loop acts on."""
        flags = torch.stack([self.first_bad, torch.tensor(stop.signal or 0, device=self.device),
                             torch.tensor(int(self.budget_pending), device=self.device)])
        first_bad, sig, budget = distributed.max_all(flags).tolist()
        self.first_bad = torch.full((), first_bad, dtype=torch.long, device=self.device)
        self.check_finite()
        if sig and not stop.signal:
            stop.signal = sig
        if budget:
            self.stop_signal = "budget"
        return int(sig)

    def log(self, step: int) -> None:
        if self.procs > 1:
            self.loss_sum = distributed.sum_all(self.loss_sum)  # every process logs at the same updates
        counted = step - self.last_log_step - self.skipped_since_log  # (skipped updates add no loss)
        loss_value = self.loss_sum.item() / counted if counted else None
        self.loss_sum.zero_()
        now = time.perf_counter()
        # Checkpoint saves since the last log are not update time: the session formula has its own
        # term for them. (Periodic validation is, amortised.)
        per_update = (now - self.last_log_t - self.paused) / (step - self.last_log_step)
        self.paused = 0.0
        self.step_times += [per_update] * (step - self.last_log_step)
        self.last_log_t, self.last_log_step = now, step
        self.check_finite()
        mem = telemetry.memory(self.device)
        grad_norm = float(self.s.grad_norm) if self.s.grad_norm is not None else None
        row = {"step": step, "loss": loss_value, "lr": self.s.scheduler.get_last_lr()[0],
               "sec_per_update": per_update, "grad_norm": grad_norm if grad_norm is not None and math.isfinite(
                   grad_norm) else None, "peak_allocated": mem["peak_allocated"],
               "peak_reserved": mem["peak_reserved"], "rss": mem["rss"], "time": time.time()}
        if self.rate:  # the meter since the set-up began, at the run's rate
            row["cost"] = round((now - self.t_setup) / 3600 * self.rate, 6)
        if loss_value is None:  # every update since the last log was skipped (their rows say so)
            del row["loss"]
        if self.skipped_since_log:
            row["skipped_updates"] = self.skipped_since_log
            self.skipped_since_log = 0
        seen = self.watch.first is not None
        if loss_value is not None and self.watch.add(step, loss_value):
            row["diverging"] = True
        self.history.append(row)
        if self.main:
            runlock.check_held(self.run_dir, f"at update {step}")  # never recreate a deleted run folder
            runlog.append(self.log_path, row)
        if self.trackers:
            self.trackers.scalars({"train/loss": loss_value, "train/lr": row["lr"], "train/sec_per_update": per_update,
                                   "train/grad_norm": row["grad_norm"], "train/peak_allocated": mem["peak_allocated"],
                                   "train/peak_reserved": mem["peak_reserved"], "train/peak_rss": mem["peak_rss"]},
                                  step)
        self.out(runlog.progress_line(step, self.total, row, self.step_times, self.device, self.budget.currency))
        if self.watch.first is not None and not seen:
            self.out(self.watch.warning())
        budget = self.budget
        if self.main and self.projection is None and len(self.step_times) >= WARMUP_UPDATES + budget.smoke_steps \
                and step < self.total:
            if not self.rec.data.get("checkpoint_seconds"):
                self.checkpoint(step)  # measure what a checkpoint costs rather than guess it (a safe point)
            ckpt = self.rec.data.get("checkpoint_seconds") or []
            self.projection = economics.project(
                budget, step=step, total=self.total, elapsed=time.perf_counter() - self.t_setup,
                seconds_per_update=telemetry.steady_state(self.step_times, WARMUP_UPDATES)["mean"],
                checkpoint_every=self.cfg.train.checkpoint_every,
                seconds_per_checkpoint=sum(ckpt) / len(ckpt) if ckpt else 0.0)
            self.out(self.projection.text(budget.currency))
            if self.projection.over:
                if self.procs > 1:
                    self.budget_pending = True  # all processes stop together, at the next update
                else:
                    self.stop_signal = "budget"

    def last_checkpoint_path(self) -> str | None:
        return str(checkpoint.step_dir(self.run_dir, self.last_good_ckpt)) if self.last_good_ckpt else None

    def validate(self, step: int) -> None:
        s = self.s
        with self.stages("evaluation"), loop.eval_weights(s):
            val = loop.validation_loss(s.trainable, s.memory, self.data.validation, self.family.collate,
                                       self.device, self.cfg.train.seed, s.accelerator.autocast)
        self.history.append({"step": step, "val_loss": val, "time": time.time()})
        if self.trackers:
            self.trackers.scalars({"val/loss": val}, step)
        if self.main:
            runlog.append(self.log_path, self.history[-1])
        self.out(f"  validation loss at update {step}: {val:.4f} ({len(self.data.validation)} held-out examples)")

    def write_adapter(self, folder: Path, ema: bool = False) -> Path:
        """The adapter to use (schedule-free: its averaged weights), or train.ema's moving average."""
        with loop.ema_weights(self.s) if ema else loop.eval_weights(self.s):
            return self.family.save_adapter(self.s.model, self.s.lora_config, folder,
                                            text_encoders=loop.text_adapters(self.s.trainable))

    def write_weights(self, folder: Path) -> None:
        """A checkpoint's weights: the adapter, the moving average, and the weights a schedule-free
        optimizer steps (what resuming needs beside the adapter)."""
        self.write_adapter(folder / "adapter")
        if self.s.ema is not None:
            self.write_adapter(folder / checkpoint.EMA_DIR, ema=True)
        if self.s.modes:
            save_file({str(i): p.detach().cpu().contiguous() for i, p in enumerate(self.s.params)},
                      str(folder / checkpoint.TRAIN_PARAMS))

    def checkpoint(self, step: int) -> Path:
        self.check_finite()
        t0 = time.perf_counter()
        if not self.main:  # one writer: the processes hold the same adapter and optimizer state
            self.last_good_ckpt = step
            return checkpoint.step_dir(self.run_dir, step)
        runlock.check_held(self.run_dir, f"at update {step}, before its checkpoint")
        with self.rec.phase("checkpoints"), self.stages("checkpoint saving"), saving(self.stop_flag):
            path = checkpoint.save(self.run_dir, step, write_weights=self.write_weights, optimizer=self.s.optimizer,
                                   scheduler=self.s.scheduler, config=self.config_dict, config_hash=self.config_hash,
                                   keep=self.cfg.train.keep_checkpoints,
                                   extra={"dataset_version": self.data.version, "total_updates": self.total,
                                          "processes": self.procs, **resume.quantization_fact(self.s)})
        seconds = time.perf_counter() - t0
        self.rec.data.setdefault("checkpoint_seconds", []).append(round(seconds, 4))
        self.paused += seconds
        self.last_good_ckpt = step
        return path

    def abandon(self, command: str) -> TrainResult:
        """A second Ctrl-C stopped the run in the middle of an update: nothing more is saved; the
        record and the message say which checkpoint is the last and how to continue from it."""
        kept = self.last_checkpoint_path()
        self.stop_signal = "SIGINT"
        if self.trackers:
            self.trackers.close()
        self.rec.set(steps_done=self.last_good_ckpt, interrupted=True, abandoned_update=self.step, signal="SIGINT",
                     last_checkpoint=kept, divergence=self.watch.first, processes=self.procs)
        rec_path = self.rec.write(status="interrupted") if self.main else None
        self.out(f"stopped at once by a second Ctrl-C during update {self.step}/{self.total}, which is not saved. "
                 + (f"The last checkpoint is {kept} (update {self.last_good_ckpt}); continue with: {command} --resume"
                    if kept else f"No checkpoint had been written yet; start again with: {command}"))
        return TrainResult(self.run_dir, None, self.last_good_ckpt, True, rec_path, "SIGINT")

    def check_finite(self) -> None:
        bad = int(self.first_bad.item())
        if bad >= 0:
            kept = (f"the last good checkpoint (update {self.last_good_ckpt}) is kept in {self.run_dir / 'checkpoints'}"
                    if self.last_good_ckpt else "no checkpoint had been written yet")
            raise NonFiniteLoss(
                f"the loss or its gradients became NaN or infinite at update {bad}; not saved. Likely causes: "
                "learning rate too high (try half), fp16 overflow (use bf16), a corrupt cache entry "
                f"(`imglora cache-latents --verify`), or min_snr/noise settings out of range. {kept}.")

    def finish(self, step: int, loop_seconds: float, command: str) -> TrainResult:
        """The last checkpoint, the adapter (when the run is complete), plots and the run record."""
        cfg, rec, out = self.cfg, self.rec, self.out
        interrupted = self.stop_signal is not None
        t_finish = time.perf_counter()
        self.check_finite()
        if self.main:
            runlock.check_held(self.run_dir, f"at update {step}, at the end of the run")
        if step == self.last_good_ckpt and step > self.start:  # already saved at this update
            ckpt_path = checkpoint.step_dir(self.run_dir, step)
        elif step > self.start or not checkpoint.list_checkpoints(self.run_dir):
            ckpt_path = self.checkpoint(step)
        else:
            ckpt_path = None
        adapter = None
        if not interrupted and self.main:
            with atomic.atomic_dir(self.run_dir / "adapter") as tmp, self.stages("checkpoint saving"):
                adapter = self.run_dir / "adapter" / self.write_adapter(tmp).relative_to(tmp)
            if self.s.ema is not None:
                with atomic.atomic_dir(self.run_dir / checkpoint.EMA_DIR) as tmp, self.stages("checkpoint saving"):
                    self.write_adapter(tmp, ema=True)
        if self.main:
            runlog.plot_loss(self.history, self.run_dir / "loss.png")
        if self.trackers:
            self.trackers.close()
        targets = self.s.lora_config.target_modules
        rec.set(finish_seconds=round(time.perf_counter() - t_finish, 3))
        rec.set(steps_done=step, interrupted=interrupted, loop_seconds=round(loop_seconds, 3),
                sec_per_update=telemetry.steady_state(self.step_times, WARMUP_UPDATES),
                peak_memory=telemetry.memory(self.device), compile_graphs=_compiled_graphs() if cfg.memory.compile != "none" else None,
                final_loss=next((r["loss"] for r in reversed(self.history) if "loss" in r), None),
                final_val_loss=next((r["val_loss"] for r in reversed(self.history) if "val_loss" in r), None),
                adapter=str(adapter) if adapter else None, last_checkpoint=str(ckpt_path) if ckpt_path else None,
                lora={"type": cfg.lora.type, "rank": cfg.lora.rank, "alpha": cfg.lora.alpha,
                      "targets": sorted(targets) if isinstance(targets, set) else targets,
                      "text_encoders": sorted(loop.text_encoders(self.s.trainable))})
        if self.projection:
            actual = time.perf_counter() - self.t_setup
            rec.set(projection={**self.projection.to_dict(), "actual_seconds": round(actual, 3),
                                "error_pct": round(100 * (self.projection.seconds - actual) / actual, 2)})
        session_hours = (time.perf_counter() - self.t_setup) / 3600
        rec.set(divergence=self.watch.first)  # None: the loss never ran away
        rec.set(skipped_updates=self.skipped or None)  # updates a non-finite gradient skipped
        rec.set(signal=self.stop_signal, processes=self.procs, gpu_hours=round(session_hours * self.procs, 5))
        if self.offer is not None or self.rate:
            rec.set(offer=economics.run_cost(rec.data, self.offer, self.rate, cfg.train.budget.currency, session_hours,
                                             self.projection if self.stop_signal == "budget" else None))
        rec_path = rec.write(status="interrupted" if interrupted else "ok") if self.main else None
        if not self.main:
            return TrainResult(self.run_dir, None, step, interrupted, rec_path, self.stop_signal)
        if self.stop_signal == "budget":
            p = self.projection
            out(f"{p.stop_advice(cfg.train.budget.currency, step, self.total)}; or pick a faster swap setting "
                f"(`imglora bench-swap`), or a cheaper or faster GPU (`imglora estimate --offer`).\n"
                f"Checkpoint {ckpt_path}; `{command} --resume` continues from here.")
        elif interrupted:
            out(f"stopped at update {step}/{self.total}; checkpoint {ckpt_path}. Continue with: {command} --resume")
        else:
            ss = telemetry.steady_state(self.step_times, WARMUP_UPDATES)
            per = f"{ss['median']:.3f} s/update (median after {WARMUP_UPDATES} warm-up updates)" if ss["median"] else ""
            diverged = (f" (warning: the loss diverged from update {self.watch.first['step']}; see the warning "
                        "above)") if self.watch.first else ""
            out(f"done: {step} updates in {telemetry.fmt_duration(loop_seconds)} {per}; adapter {adapter}{diverged}")
        return TrainResult(self.run_dir, adapter, step, interrupted, rec_path, self.stop_signal)


def _compiled_graphs() -> dict[str, int]:
    from ..memory import compile as compiled  # (imported only where memory.compile is on)

    return compiled.graphs()

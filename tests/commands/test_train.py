from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from imglora.families._shared.diffusers_image import ADAPTER_FILE
from imglora.commands.common import load_config
from imglora.training import checkpoint
from imglora.adapters import inject as lora
from imglora.runs import record
from imglora.families import get_family
from imglora.models.resolve import resolve_model
from imglora.commands.train import train
from imglora.training.step import make_scheduler
from imglora.training.trainer import NonFiniteLoss
from imglora.memory.wrap import resolve_swap
from loading import load_tiny

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-sdxl.toml"


@pytest.fixture()
def small(small_run):
    """Three sample images and overrides that keep a run to a few seconds."""
    return small_run() + ["train.max_steps=8", "train.checkpoint_every=2", "train.log_every=1",
                          "train.warmup_steps=2"]


def load_cfg(overrides, *extra):
    return load_config(PRESET, [*overrides, *extra])


def quiet(_: str) -> None:
    pass


def cli(args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "imglora.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def set_args(overrides) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def test_lr_schedules_are_diffusers_get_scheduler(small) -> None:
    def lrs(*extra: str, total: int = 10, steps=(0, 1, 2, 6, 10)) -> list[float]:
        cfg = load_cfg(small, "train.learning_rate=0.5", *extra)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.train.learning_rate)
        sched = make_scheduler(cfg, opt, total)
        out = []
        for s in range(max(steps) + 1):
            if s in steps:
                out.append(round(sched.get_last_lr()[0] / 0.5, 4))
            opt.step()
            sched.step()
        return out

    # As kohya sd-scripts (diffusers' schedules): warmup from 0, then the decay.
    assert lrs('train.scheduler="cosine"', "train.warmup_steps=2") == [0.0, 0.5, 1.0, 0.5, 0.0]
    assert lrs('train.scheduler="linear"', "train.warmup_steps=0", total=4, steps=(0, 1, 2, 3, 4)) == \
        [1.0, 0.75, 0.5, 0.25, 0.0]
    assert lrs('train.scheduler="constant"', "train.warmup_steps=3", steps=(0, 1, 3, 9)) == [0.0, 0.3333, 1.0, 1.0]
    assert lrs('train.scheduler="cosine_with_restarts"', "train.scheduler_cycles=2", "train.warmup_steps=0",
               steps=(0, 2, 5, 7)) == [1.0, 0.6545, 1.0, 0.6545]
    assert lrs('train.scheduler="polynomial"', "train.scheduler_power=2", "train.warmup_steps=0",
               steps=(0, 5)) == [1.0, 0.25]


def test_run_writes_adapter_log_png_and_record(small) -> None:
    cfg = load_cfg(small)
    result = train(cfg, out=quiet)
    run = cfg.run_dir
    assert result.adapter == run / "adapter" / ADAPTER_FILE and result.adapter.is_file()
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(set(r) >= {"loss", "lr", "sec_per_update", "peak_allocated", "rss"} for r in rows)
    assert rows[0]["lr"] == pytest.approx(cfg.train.learning_rate * 0.5)  # warmup 2: 1/2 after the first update
    assert rows[1]["lr"] == pytest.approx(cfg.train.learning_rate)
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [s for s, _ in checkpoint.list_checkpoints(run)] == [4, 6, 8]  # keep_checkpoints = 3
    rec = record.read_records(run, "train")[-1]
    assert rec["status"] == "ok" and rec["steps_done"] == 8
    assert rec["sec_per_update"]["median"] > 0 and rec["sec_per_update"]["n"] == 5
    assert rec["setup_seconds"] > 0 and rec["peak_memory"]["peak_rss"] > 0
    assert set(rec["phases"]) >= {"cache", "load_model", "train_loop", "checkpoints"}
    assert rec["environment"]["diffusers"] and len(rec["dataset_version"]) == 64
    assert rec["lora"]["rank"] == 8 and rec["lora"]["alpha"] == 8.0


@pytest.mark.slow  # (the default run stays under 6 minutes; CI runs it)
def test_adapter_loads_in_diffusers_and_matches_peft_model(small) -> None:
    from diffusers import StableDiffusionXLPipeline

    cfg = load_cfg(small, "lora.alpha=4", "train.max_steps=3", "train.checkpoint_every=0")  # alpha != rank
    result = train(cfg, out=quiet)
    model_dir = resolve_model("tiny:sdxl", get_family("sdxl"))
    family = get_family("sdxl")

    torch.manual_seed(0)
    x = torch.randn(1, 4, 16, 16)
    t = torch.tensor([500])
    cond = {"encoder_hidden_states": torch.randn(1, 77, 64),
            "added_cond_kwargs": {"text_embeds": torch.randn(1, 32), "time_ids": torch.tensor([[128., 128, 0, 0, 128, 128]])}}

    trainable = load_tiny(family, model_dir, cfg)
    unet = trainable.model.eval()
    with torch.no_grad():
        base = unet(x, t, **cond).sample
    peft_cfg = lora.inject(unet, family, cfg.lora, seed=0)
    weights = load_file(str(result.adapter))
    assert all(k.startswith("unet.") for k in weights)
    lora.load_adapter_state(unet, {k[len("unet."):]: v for k, v in weights.items()})
    assert peft_cfg.lora_alpha == 4 and peft_cfg.r == 8
    with torch.no_grad():
        peft_out = unet(x, t, **cond).sample

    pipe = StableDiffusionXLPipeline.from_pretrained(model_dir.root)
    pipe.load_lora_weights(str(result.adapter.parent))
    with torch.no_grad():
        pipe_out = pipe.unet(x, t, **cond).sample
    assert (peft_out - base).abs().max() > 1e-3  # the adapter changes the output
    torch.testing.assert_close(pipe_out, peft_out, rtol=1e-5, atol=1e-5)


def test_only_lora_parameters_train(small) -> None:
    cfg = load_cfg(small)
    family = get_family("sdxl")
    src = resolve_model("tiny:sdxl", family)
    trainable = family.load_trainable(src, cfg, torch.device("cpu"), torch.float32, resolve_swap(family, cfg, src))
    unet = trainable.model
    lora.inject(unet, family, cfg.lora, seed=1)
    base_before = {n: p.detach().clone() for n, p in unet.named_parameters() if "lora_" not in n}
    lora_before = {n: p.detach().clone() for n, p in unet.named_parameters() if "lora_" in n}
    assert all(p.requires_grad == ("lora_" in n) for n, p in unet.named_parameters())
    opt = torch.optim.AdamW(lora.trainable_parameters(unet), lr=1e-2)
    batch = {"latents": torch.randn(1, 4, 16, 16), "prompt_embeds": torch.randn(1, 77, 64),
             "pooled_prompt_embeds": torch.randn(1, 32), "time_ids": torch.tensor([[128., 128, 0, 0, 128, 128]])}
    for _ in range(2):
        trainable.loss(batch, torch.Generator().manual_seed(0)).backward()
        assert all((p.grad is not None) == ("lora_" in n) for n, p in unet.named_parameters())
        opt.step()
        opt.zero_grad()
    after = dict(unet.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in base_before.items())
    changed = [n for n, v in lora_before.items() if not torch.equal(after[n], v)]
    assert len(changed) == len(lora_before)  # every A and B moved (B from zero)


def _nan_gradient_at(updates, monkeypatch) -> dict[str, str]:
    """From the updates in ``updates`` on (1-based, per loss call), one LoRA weight of the UNet's first
    attention gets a NaN gradient while the loss stays finite (as on the first H200 run). Returns
    {"name": the parameter's name} once the run has set it up."""
    from imglora.families import sdxl

    real = sdxl.model.SdxlTrainable.loss
    calls = {"n": 0}
    planted: dict[str, str] = {}

    def nan_gradient(self, batch, gen):
        calls["n"] += 1
        if not planted:
            name, param = next((n, p) for n, p in self.model.named_parameters()
                               if p.requires_grad and "attn1.to_k.lora_B" in n)
            planted["name"] = name
            param.register_hook(lambda g: g * float("nan") if calls["n"] in updates else g)
        return real(self, batch, gen)

    monkeypatch.setattr(sdxl.model.SdxlTrainable, "loss", nan_gradient)
    return planted


def test_an_update_with_a_nan_gradient_is_skipped_named_and_the_run_goes_on(small, monkeypatch) -> None:
    planted = _nan_gradient_at({4}, monkeypatch)
    lines: list[str] = []
    cfg = load_cfg(small)
    result = train(cfg, out=lines.append)
    assert result.steps_done == 8 and result.adapter is not None  # one skipped update does not stop the run
    rows = [json.loads(x) for x in (cfg.run_dir / "log.jsonl").read_text().splitlines()]
    skipped = [r for r in rows if "skipped" in r]
    module = planted["name"].split(".lora_B")[0]
    assert len(skipped) == 1 and skipped[0]["step"] == 4 and skipped[0]["grad_norm"] == "nan"
    assert skipped[0]["nonfinite_gradient"] == planted["name"] and skipped[0]["skipped_in_row"] == 1
    logged = {r["step"]: r for r in rows if "sec_per_update" in r}
    assert logged[4]["skipped_updates"] == 1 and "loss" not in logged[4]  # log_every=1: no loss to average
    assert all(r.get("skipped_updates") is None and r["loss"] > 0 for s, r in logged.items() if s != 4)
    warning = next(x for x in lines if x.startswith("warning: update 4 skipped"))
    assert f"first non-finite gradient: {planted['name']} (module {module})" in warning
    assert "1 in a row, the run stops after 3 (train.max_skipped_updates)" in warning
    assert json.loads(result.record.read_text())["skipped_updates"] == [4]
    weights = load_file(str(result.adapter))
    assert all(torch.isfinite(v).all() for v in weights.values())


def test_the_skipped_update_leaves_weights_optimizer_and_schedule_as_they_were(small, monkeypatch) -> None:
    """Update 3's gradient is NaN: after it the adapter, the optimizer's state and the learning rate are
    exactly as update 2 left them (copies of the same memory, nothing computed: bit-equal)."""
    from imglora.training import trainer as training

    _nan_gradient_at({3}, monkeypatch)
    seen: dict[int, dict] = {}
    real = training._Run.note_skip

    def note_skip(self, step):
        real(self, step)
        state = self.s.optimizer.state_dict()["state"]
        seen[step] = {"lr": self.s.scheduler.get_last_lr()[0], "params": [p.detach().clone() for p in self.s.params],
                      "state": [v.clone() for st in state.values() for v in st.values() if torch.is_tensor(v)]}

    monkeypatch.setattr(training._Run, "note_skip", note_skip)
    cfg = load_cfg(small, "train.max_steps=4", "train.warmup_steps=4")
    train(cfg, out=quiet)
    two, three, four = seen[2], seen[3], seen[4]
    assert all(torch.equal(a, b) for a, b in zip(two["params"], three["params"]))
    assert len(two["state"]) > 0 and all(torch.equal(a, b) for a, b in zip(two["state"], three["state"]))
    # warmup 4: the schedule stepped for updates 1 and 2 only, then for 4
    assert three["lr"] == two["lr"] == pytest.approx(cfg.train.learning_rate * 2 / 4)
    assert four["lr"] == pytest.approx(cfg.train.learning_rate * 3 / 4)
    assert not all(torch.equal(a, b) for a, b in zip(three["params"], four["params"]))  # update 4 trained


def test_too_many_skipped_updates_in_a_row_stop_with_the_module_and_a_finite_checkpoint(small, monkeypatch) -> None:
    planted = _nan_gradient_at(set(range(3, 100)), monkeypatch)
    cfg = load_cfg(small, "train.max_skipped_updates=1")
    with pytest.raises(NonFiniteLoss) as exc:
        train(cfg, out=quiet)
    msg = str(exc.value)
    module = planted["name"].split(".lora_B")[0]
    assert msg.startswith("2 updates in a row (up to update 4) had NaN or infinite gradients and were skipped "
                          "(train.max_skipped_updates = 1); first non-finite gradient: "
                          f"{planted['name']} (module {module}).")
    assert 'memory.attention_kernel=\"math\"' in msg and "learning rate" in msg
    assert [s for s, _ in checkpoint.list_checkpoints(cfg.run_dir)] == [2, 4]
    two = load_file(str(checkpoint.step_dir(cfg.run_dir, 2) / "adapter" / ADAPTER_FILE))
    four = load_file(str(checkpoint.step_dir(cfg.run_dir, 4) / "adapter" / ADAPTER_FILE))
    assert all(torch.equal(two[k], four[k]) for k in two)  # nothing of updates 3 and 4 reached the weights
    assert f"saved in {checkpoint.step_dir(cfg.run_dir, 4)}" in msg
    assert not (cfg.run_dir / "adapter").exists()


def test_max_skipped_updates_zero_stops_at_the_first(small, monkeypatch) -> None:
    _nan_gradient_at({5}, monkeypatch)
    cfg = load_cfg(small, "train.max_skipped_updates=0")
    with pytest.raises(NonFiniteLoss, match=r"^1 updates in a row \(up to update 5\)"):
        train(cfg, out=quiet)


def test_a_nan_loss_under_finite_gradients_still_stops_before_it_is_saved(small, monkeypatch) -> None:
    """A NaN that reaches only the loss's value (a detached term) leaves the gradients finite: the
    update is applied, but the run stops at the next log with the old message, unsaved."""
    from imglora.families import sdxl

    real = sdxl.model.SdxlTrainable.loss
    calls = {"n": 0}

    def nan_value(self, batch, gen):
        calls["n"] += 1
        loss = real(self, batch, gen)
        return loss + torch.tensor(float("nan")).detach() if calls["n"] == 5 else loss

    monkeypatch.setattr(sdxl.model.SdxlTrainable, "loss", nan_value)
    cfg = load_cfg(small)
    with pytest.raises(NonFiniteLoss) as exc:
        train(cfg, out=quiet)
    msg = str(exc.value)
    assert "NaN or infinite at update 5" in msg and "last good checkpoint (update 4)" in msg
    assert [s for s, _ in checkpoint.list_checkpoints(cfg.run_dir)] == [2, 4]


def test_resume_refuses_changed_training_settings(small) -> None:
    cfg = load_cfg(small, "train.max_steps=2")
    train(cfg, out=quiet)
    changed = load_cfg(small, "train.max_steps=2", "train.learning_rate=5e-4", "lora.rank=4", "train.log_every=2")
    with pytest.raises(checkpoint.ResumeRefused) as exc:
        train(changed, resume=True, out=quiet)
    msg = str(exc.value)
    assert "lora.rank: 8 in the checkpoint, 4 now" in msg
    assert "train.learning_rate: 0.003 in the checkpoint, 0.0005 now" in msg
    assert "log_every" not in msg  # does not change what is trained


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(small, tmp_path: Path) -> None:
    base = [o for o in small if not o.startswith(("run.output_dir", "train.max_steps"))]
    common = [*base, "train.max_steps=14"]

    ref = cli(["train", str(PRESET), *set_args([*common, f"run.output_dir={json.dumps(str(tmp_path / 'ref'))}"])])
    out, _ = ref.communicate(timeout=600)
    assert ref.returncode == 0, out

    killed_dir = tmp_path / "killed"
    args = ["train", str(PRESET), *set_args([*common, f"run.output_dir={json.dumps(str(killed_dir))}"])]
    victim = cli(args)
    ckpt = killed_dir / "tiny-sdxl" / "checkpoints" / "step-000004"
    deadline = time.time() + 300
    while not ckpt.exists() and time.time() < deadline and victim.poll() is None:
        time.sleep(0.02)
    assert victim.poll() is None, "the run finished before it could be killed"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not (killed_dir / "tiny-sdxl" / "adapter").exists()

    resumed = cli([*args, "--resume"])
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    assert "resuming from" in out
    a = load_file(str(tmp_path / "ref" / "tiny-sdxl" / "adapter" / ADAPTER_FILE))
    b = load_file(str(killed_dir / "tiny-sdxl" / "adapter" / ADAPTER_FILE))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed adapter differs from the uninterrupted one"



def test_complete_cache_means_no_encoder_is_loaded(small, monkeypatch) -> None:
    cfg = load_cfg(small, "train.max_steps=1", "train.checkpoint_every=0", "train.warmup_steps=0")
    train(cfg, out=quiet)
    from imglora.families import sdxl

    def refuse(*a, **k):
        raise AssertionError("an encoder was loaded although the cache is complete")

    monkeypatch.setattr(sdxl.SdxlFamily, "load_vae", refuse)
    monkeypatch.setattr(sdxl.SdxlFamily, "load_text_encoders", refuse)
    lines: list[str] = []
    train(load_cfg(small, "train.max_steps=1", "train.checkpoint_every=0", "train.warmup_steps=0", "run.name=second"),
          out=lines.append)
    assert any("cache 0 encoded / 6 reused" in line for line in lines)


def test_optimizers_and_epochs(small) -> None:
    from imglora.errors import ImgloraError
    from imglora.training.step import make_optimizer, total_updates

    p = torch.nn.Parameter(torch.ones(3))
    opt = make_optimizer(load_cfg(small, "train.optimizer=\"adafactor\""), [p])
    p.grad = torch.ones(3)
    opt.step()
    assert not torch.equal(p.detach(), torch.ones(3))
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        with pytest.raises(ImgloraError, match="needs bitsandbytes: `pip install bitsandbytes`"):
            make_optimizer(load_cfg(small, "train.optimizer=\"adamw8bit\""), [p])
    # 3 images x 2 epochs = 6 micro-batches; accumulation 4 -> 2 updates (the last one partial).
    cfg = load_cfg(small, "train.max_steps=0", "train.epochs=2", "train.grad_accum=4")
    assert total_updates(cfg, micro_per_epoch=3) == 2


def test_a_new_run_never_overwrites_an_earlier_one(small) -> None:
    from imglora.errors import ImgloraError

    cfg = load_cfg(small, "train.max_steps=2")
    train(cfg, out=quiet)
    before = (cfg.run_dir / "adapter" / ADAPTER_FILE).read_bytes()
    with pytest.raises(ImgloraError, match=r"already holds a run \(newest checkpoint: update 2\).*--resume.*run.name"):
        train(cfg, out=quiet)
    assert (cfg.run_dir / "adapter" / ADAPTER_FILE).read_bytes() == before


@pytest.mark.slow
def test_resume_skips_a_damaged_checkpoint_and_refuses_changed_data(small, tmp_path, monkeypatch) -> None:
    cfg = load_cfg(small, "train.max_steps=6")  # checkpoints at 2, 4 and 6
    train(cfg, out=quiet)
    newest = checkpoint.list_checkpoints(cfg.run_dir)[-1][1]
    (newest / "optimizer.safetensors").write_bytes(b"")  # as a full disk or a hard stop might leave it
    lines: list[str] = []
    result = train(cfg, resume=True, out=lines.append)
    assert any("skipped a damaged checkpoint" in x and str(newest) in x for x in lines)
    assert any("resuming from" in x and "step-000004" in x for x in lines)
    assert result.steps_done == 6
    (tmp_path / "data" / "01_sky.txt").write_text("sks toy, another caption")
    from imglora.families import sdxl

    def never(*a, **k):
        raise AssertionError("encoders or the model were loaded before the data check")

    for name in ("load_vae", "load_text_encoders", "load_trainable"):
        monkeypatch.setattr(sdxl.SdxlFamily, name, never)
    longer = load_cfg(small, "train.max_steps=8")  # at 6 of 6 the run is complete: nothing to refuse
    with pytest.raises(checkpoint.ResumeRefused, match="the dataset changed since"):
        train(longer, resume=True, out=quiet)


def test_missing_bitsandbytes_or_cuda_fails_before_anything_loads(monkeypatch, tmp_path) -> None:
    from imglora.errors import ImgloraError
    from imglora.families import llm

    def never(*a, **k):
        raise AssertionError("the model was loaded before the dependency check")

    monkeypatch.setattr(llm.LlmFamily, "prepare_data", never)
    monkeypatch.setattr(llm.LlmFamily, "load_trainable", never)
    cfg = load_config(REPO / "presets" / "tiny-llm.toml", ['memory.quantization="nf4"',
                                                          f"run.output_dir={json.dumps(str(tmp_path))}"])
    with pytest.raises(ImgloraError, match='memory.quantization = "nf4" needs (bitsandbytes|a CUDA GPU)'):
        train(cfg, out=quiet)


@pytest.mark.slow
def test_sigterm_checkpoints_exits_143_and_prints_the_exact_resume_command(small, tmp_path: Path) -> None:
    term_dir = tmp_path / "term"
    overrides = [*[o for o in small if not o.startswith(("run.output_dir", "train.max_steps", "train.checkpoint"))],
                 "train.max_steps=400", "train.checkpoint_every=0", f"run.output_dir={json.dumps(str(term_dir))}"]
    proc = cli(["train", str(PRESET), *set_args(overrides)])
    log = term_dir / "tiny-sdxl" / "log.jsonl"
    deadline = time.time() + 300
    while not (log.exists() and log.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, out  # 128 + SIGTERM: "interrupted, resumable" to a scheduler
    steps = [s for s, _ in checkpoint.list_checkpoints(term_dir / "tiny-sdxl")]
    assert len(steps) == 1 and 2 <= steps[0] < 400
    rec = record.read_records(term_dir / "tiny-sdxl", "train")[-1]
    assert rec["status"] == "interrupted" and rec["signal"] == "SIGTERM"
    # The resume hint repeats every --set, so it finds this run folder again.
    import shlex

    expected = shlex.join(["imglora", "train", str(PRESET), *set_args(overrides)]) + " --resume"
    assert f"Continue with: {expected}" in out
    assert all(line.startswith("[") for line in out.splitlines() if "s/update" in line)  # timestamped in a pipe


def test_a_second_trainer_into_the_same_run_refuses_at_once(small, tmp_path: Path) -> None:
    from imglora.training.runlock import RunInUse

    cfg = load_cfg(small)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom imglora.training import runlock\n"
                               "with runlock.hold(sys.argv[1], 'imglora train first'):\n"
                               "    print('held', flush=True); time.sleep(120)", str(cfg.run_dir)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunInUse, match=rf"in use by another imglora process \(pid {holder.pid}.*imglora train first"):
            train(cfg, out=quiet)
        assert not (cfg.run_dir / "log.jsonl").exists() and not (cfg.run_dir / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()


def test_stale_temporaries_of_a_killed_run_are_cleaned_on_start(small) -> None:
    cfg = load_cfg(small, "train.max_steps=2")
    orphan = cfg.run_dir / "checkpoints" / ".step-000004.k3j2.tmp"
    orphan.mkdir(parents=True)
    (orphan / "optimizer.safetensors").write_bytes(b"\0" * 3_000_000)
    lines: list[str] = []
    train(cfg, out=lines.append)
    assert not orphan.exists()
    assert any(line.startswith("cleanup: removed") and ".step-000004.k3j2.tmp" in line and "2.9 MiB" in line
               for line in lines)


def test_unwritable_places_are_named_before_any_model_loads(small, tmp_path: Path, monkeypatch) -> None:
    from imglora.util.atomic import WriteError
    from imglora.families import sdxl

    def never(*a, **k):
        raise AssertionError("a model was loaded before the output folders were checked")

    monkeypatch.setattr(sdxl.SdxlFamily, "load_vae", never)
    monkeypatch.setattr(sdxl.SdxlFamily, "load_trainable", never)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(WriteError, match=r"run.output_dir: cannot write into .*a_file.*a file stands where a folder"):
        train(load_cfg(small, f"run.output_dir={json.dumps(str(blocker))}"), out=quiet)
    with pytest.raises(WriteError, match=r"cache.dir: cannot write into .*a_file"):
        train(load_cfg(small, f"cache.dir={json.dumps(str(blocker / 'cache'))}"), out=quiet)


def test_disk_full_while_checkpointing_names_the_path_and_keeps_the_last_checkpoint(small, monkeypatch) -> None:
    from safetensors import SafetensorError

    from imglora.util.atomic import WriteError

    real = checkpoint.save_file
    calls = {"n": 0}

    def filling_disk(tensors, path, *a, **k):
        if path.endswith("optimizer.safetensors"):
            calls["n"] += 1
            if calls["n"] == 2:  # the second checkpoint hits a full disk
                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(checkpoint, "save_file", filling_disk)
    cfg = load_cfg(small)
    with pytest.raises(WriteError, match=r"step-000004: the disk is full"):
        train(cfg, out=quiet)
    assert [s for s, _ in checkpoint.list_checkpoints(cfg.run_dir)] == [2]
    assert load_file(str(checkpoint.step_dir(cfg.run_dir, 2) / "adapter" / ADAPTER_FILE))
    assert not [p for p in (cfg.run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")]


def test_too_many_swapped_blocks_refused_before_loading(small, monkeypatch) -> None:
    from imglora.errors import ImgloraError
    from imglora.families import flux

    def never(*a, **k):
        raise AssertionError("loaded before the swap setting was checked")

    monkeypatch.setattr(flux.FluxFamily, "prepare_data", never)
    monkeypatch.setattr(flux.FluxFamily, "load_trainable", never)
    cfg = load_config(REPO / "presets" / "tiny-flux.toml", [*small, "memory.blocks_to_swap=11"])
    with pytest.raises(ImgloraError, match=r"memory.blocks_to_swap = 11: swapping 11 blocks means 5 double"):
        train(cfg, out=quiet)
    cfg = load_config(REPO / "presets" / "tiny-flux.toml", [*small, "memory.blocks_to_swap=0", "flux.double_blocks_to_swap=5"])
    with pytest.raises(ImgloraError, match=r"flux.double_blocks_to_swap = 5, but the model has only 4"):
        train(cfg, out=quiet)


def test_divergence_rule_ignores_spikes_and_noise_and_names_a_runaway_loss() -> None:
    from imglora.runs.log import DivergenceWatch

    healthy = DivergenceWatch()  # a diffusion loss varies 100x between single updates; its median does not
    noisy = [0.9, 0.004, 0.6, 0.02, 1.1, 0.3, 0.008, 0.7, 0.5, 40.0, 0.4, 0.05, 0.9, 0.3]  # one 40.0 spike
    assert not any(healthy.add(step, loss) for step, loss in enumerate(noisy, 1)) and healthy.first is None
    runaway = DivergenceWatch()
    flags = [runaway.add(step, loss) for step, loss in enumerate([1.15, 1.62, 2084.0, 610.0, 4449.0, 90.0], 1)]
    assert flags == [False, False, False, True, True, True]
    assert runaway.first == {"step": 4, "median_loss": 305.81, "lowest_median_loss": 1.62, "lowest_at": 3,
                             "rule": DivergenceWatch.RULE}
    assert runaway.warning().startswith("warning: the loss is diverging: at update 4 its running median over the "
                                        "last 5 logs is 305.8, more than 10x its lowest (1.62 at update 3)")


@pytest.mark.slow  # (the default run stays under 6 minutes in a fresh clone; CI runs it)
def test_a_diverging_run_is_warned_about_in_the_log_the_output_and_the_record(small) -> None:
    cfg = load_cfg(small, "train.learning_rate=1.0", "train.max_grad_norm=0", "train.warmup_steps=0",
                   "train.checkpoint_every=0")
    lines: list[str] = []
    result = train(cfg, out=lines.append)
    warning = [x for x in lines if x.startswith("warning: the loss is diverging: at update ")]
    assert len(warning) == 1 and "more than 10x its lowest" in warning[0], lines  # once, not at every log
    rec = json.loads(result.record.read_text())
    first = rec["divergence"]
    assert first["median_loss"] > 10 * first["lowest_median_loss"] and first["rule"].startswith("running median")
    rows = [json.loads(x) for x in (cfg.run_dir / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("diverging")][0] == first["step"]
    assert f"(warning: the loss diverged from update {first['step']}; see the warning above)" in lines[-1]


def test_a_second_ctrl_c_during_an_update_stops_at_once_naming_the_last_checkpoint(small, monkeypatch) -> None:
    from imglora.training import step as loop, trainer as training

    cfg = load_cfg(small)
    real_step, calls = loop.step, []

    def step(*args, **kw):  # Ctrl-C twice, a second apart (REPEAT_S = 0 here), while update 3 runs
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(*args, **kw)

    monkeypatch.setattr(loop, "step", step)
    monkeypatch.setattr(training._StopFlag, "REPEAT_S", 0.0)
    lines: list[str] = []
    result = train(cfg, command="imglora train x", out=lines.append)
    kept = cfg.run_dir / "checkpoints" / "step-000002"
    assert result.interrupted and result.signal == "SIGINT" and result.steps_done == 2 and result.adapter is None
    assert lines[-1] == (f"stopped at once by a second Ctrl-C during update 3/8, which is not saved. The last "
                         f"checkpoint is {kept} (update 2); continue with: imglora train x --resume")
    assert [s for s, _ in checkpoint.list_checkpoints(cfg.run_dir)] == [2]
    rec = json.loads(result.record.read_text())
    assert rec["status"] == "interrupted" and rec["abandoned_update"] == 3 and rec["last_checkpoint"] == str(kept)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are given back


@pytest.mark.slow
def test_ctrl_c_pressed_three_times_at_once_still_saves_and_exits_130(small, tmp_path: Path) -> None:
    overrides = [*[o for o in small if not o.startswith(("train.max_steps", "train.checkpoint"))],
                 "train.max_steps=400", "train.checkpoint_every=0"]
    proc = cli(["train", str(PRESET), *set_args(overrides)], start_new_session=True)
    out = ""
    for line in proc.stdout:  # wait for two logged updates
        out += line
        if "2/400" in line:
            break
    # As a user pressing Ctrl-C repeatedly: three SIGINTs to the process group within 0.2 s (apart enough that
    # Python does not merge them all into one call of the handler while a torch operation runs).
    for _ in range(3):
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.1)
    out += proc.communicate(timeout=300)[0]
    assert proc.returncode == 130, out
    assert ("SIGINT received: finishing this update, then saving a checkpoint. Press Ctrl-C again, a second or "
            "more from now, to stop at once without saving this update (no checkpoint has been written yet)") in out
    again = ("SIGINT received again: already stopping after this update, then saving a checkpoint",
             "SIGINT received again: the checkpoint is being written and is not abandoned; it ends in a moment")
    assert 1 <= sum(out.count(x) for x in again) <= 2, out  # (the run may have ended before the third)
    steps = [s for s, _ in checkpoint.list_checkpoints(tmp_path / "runs" / "tiny-sdxl")]
    assert len(steps) == 1 and f"stopped at update {steps[0]}/400; checkpoint " in out and "--resume" in out
    assert "Aborted!" not in out


def test_a_run_folder_deleted_mid_run_stops_the_run_and_is_not_recreated(small, monkeypatch) -> None:
    import shutil

    from imglora.training import step as loop
    from imglora.training.runlock import RunFolderGone

    cfg = load_cfg(small)
    real_step, calls = loop.step, []

    def step(*args, **kw):  # `rm -rf` of the run folder while update 3 runs
        calls.append(1)
        if len(calls) == 3:
            shutil.rmtree(cfg.run_dir)
        return real_step(*args, **kw)

    monkeypatch.setattr(loop, "step", step)
    with pytest.raises(RunFolderGone, match=r"the run folder .* was deleted, or its lock file \.imglora\.lock removed, "
                                            r"while this run was writing there \(noticed at update 3\)") as err:
        train(cfg, out=quiet)
    assert err.value.exit_code == 4 and len(calls) == 3
    assert not cfg.run_dir.exists()  # neither the log nor a checkpoint recreated it without its lock

"""An out-of-memory error in each stage of a run: one message with the stage and the changes to
make, kept in the run record, and the last good checkpoint untouched (failures injected on the CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from imglora.training import checkpoint
from imglora.runs import record
from imglora.cli import main
from imglora.commands.common import load_config
from imglora.commands.train import train
from imglora.training.oom import OutOfMemory, kind_of

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-sdxl.toml"


def gpu_oom(*a, **k):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def host_oom(*a, **k):
    raise MemoryError()


def on_call(n: int, real, error=gpu_oom):
    """``real``, except that its ``n``-th call fails."""
    calls = {"n": 0}

    def wrapped(*a, **k):
        calls["n"] += 1
        if calls["n"] == n:
            error()
        return real(*a, **k)

    return wrapped


def inject(stage: str, monkeypatch) -> None:
    from accelerate import Accelerator

    from imglora.training import step as loop
    from imglora.families import sdxl

    if stage == "caching":
        monkeypatch.setattr(sdxl.SdxlFamily, "prepare_data", host_oom)
    elif stage == "loading":
        monkeypatch.setattr(sdxl.SdxlFamily, "load_trainable", gpu_oom)
    elif stage == "quantizing":
        monkeypatch.setattr(loop, "apply_memory", gpu_oom)
    elif stage == "first forward":
        monkeypatch.setattr(sdxl.model.SdxlTrainable, "loss", on_call(1, sdxl.model.SdxlTrainable.loss))
    elif stage == "first backward":
        monkeypatch.setattr(Accelerator, "backward", on_call(1, Accelerator.backward))
    elif stage == "optimizer first step":
        monkeypatch.setattr(torch.optim.AdamW, "step", on_call(1, torch.optim.AdamW.step))
    elif stage == "forward":  # update 3, after the checkpoint of update 2 (call 3 is update 2's validation)
        monkeypatch.setattr(sdxl.model.SdxlTrainable, "loss", on_call(4, sdxl.model.SdxlTrainable.loss))
    elif stage == "checkpoint saving":  # the second checkpoint (update 4) fails
        monkeypatch.setattr(checkpoint, "save", on_call(2, checkpoint.save, host_oom))
    elif stage == "evaluation":  # the validation of update 4, after the checkpoint of update 2
        monkeypatch.setattr(loop, "validation_loss", on_call(2, loop.validation_loss))


@pytest.mark.parametrize("stage,kind,fix,ckpt", [
    ("caching", "host", "cache-latents", False),
    ("loading", "device", "memory.fp8 = true", False),
    pytest.param(*("quantizing", "device", "memory.blocks_to_swap", False), marks=pytest.mark.slow),  # (the default run stays under 6 minutes)
    pytest.param(*("first forward", "device", "memory.offload_checkpoints = true", False), marks=pytest.mark.slow),  # (the default run stays under 6 minutes)
    ("first backward", "device", "lora.rank", False),
    pytest.param(*("optimizer first step", "device", "adamw8bit", False), marks=pytest.mark.slow),  # (the default run stays under 6 minutes)
    ("forward", "device", "expandable_segments", True),
    ("checkpoint saving", "host", "lora.rank", True),
    pytest.param(*("evaluation", "device", "eval.every = 0", True), marks=pytest.mark.slow),  # (the default run stays under 6 minutes)
])
def test_out_of_memory_names_its_stage_and_the_fix(stage, kind, fix, ckpt, small_run, monkeypatch) -> None:
    cfg = load_config(PRESET, small_run() + ["train.max_steps=4", "train.warmup_steps=1", "train.checkpoint_every=2", "train.log_every=1",
                                             "eval.holdout=1", "eval.every=2"])
    inject(stage, monkeypatch)
    with pytest.raises(OutOfMemory) as err:
        train(cfg, out=lambda s: None)
    msg = str(err.value)
    assert err.value.stage == stage and err.value.kind == kind
    assert msg.startswith(f"out of {'GPU' if kind == 'device' else 'host'} memory during {stage} (")
    assert "To fit:" in msg and fix in msg
    rec = record.read_records(cfg.run_dir, "train")[-1]
    assert rec["status"] == "out_of_memory" and rec["failure"]["stage"] == stage and rec["failure"]["memory"] == kind
    kept = checkpoint.list_checkpoints(cfg.run_dir)
    if ckpt:  # the checkpoint written before the failure is there, whole, and named
        assert [s for s, _ in kept] == [2] and (kept[0][1] / "adapter").is_dir()
        assert f"untouched: {kept[0][1]}" in msg
    else:
        assert kept == [] and "No checkpoint had been written yet" in msg
    assert not (cfg.run_dir / "adapter").exists()


def test_the_cli_exits_5_with_the_message_alone(small_run, monkeypatch) -> None:
    from imglora.families import sdxl

    monkeypatch.setattr(sdxl.SdxlFamily, "load_trainable", gpu_oom)
    args = ["train", str(PRESET)] + [x for o in small_run() + ["train.max_steps=2", "train.warmup_steps=1"] for x in ("--set", o)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 5, r.output
    assert "out of GPU memory during loading" in r.output and "Traceback" not in r.output


def test_what_counts_as_out_of_memory() -> None:
    assert kind_of(torch.OutOfMemoryError("x")) == "device" and kind_of(MemoryError()) == "host"
    assert kind_of(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")) \
        == "host"
    assert kind_of(RuntimeError("shape mismatch")) is None and kind_of(ValueError("out of memory")) is None

"""``imglora train`` through its real entry point on the CUDA stand-in (tests/cuda_standin.py).

The CLI runs in this process with torch.cuda replaced by :class:`AsyncCuda` and
``devices.REHEARSING_CUDA_ON_CPU`` set, so every CUDA branch of the product runs: the batch staged in
page-locked memory and copied ``non_blocking``, bf16 mixed precision and text-encoder outputs, fp8
base weights, block swap with its copy stream and events, checkpoint boundaries offloaded on their
side stream, CUDA memory statistics and the run record's device facts. The presets are the shipped
tiny ones, which extend presets/flux.toml and presets/sdxl.toml (every memory setting of those, on a
model small enough for the CPU; tiny-flux swaps 4 blocks where flux.toml swaps 18). Checkpoint
boundaries are a few KiB here, so offload's size floor is lowered to move them all.

What runs here is checked two ways: no ordering violation, whatever the copy latencies (several
fuzzed schedules); and the adapter trained with copies landing at random equals the one trained with
each copy landing as late as allowed, since a kernel that read a copy before it landed would see
other bytes. The full-size FLUX.1-dev architecture is not run here (real tensors of 12B parameters
do not fit this machine); `imglora plan` runs it on the meta device.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from cuda_standin import AsyncCuda

from imglora.cli import main
from imglora.memory import offload
from imglora.util.owned import load_file

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps one process-wide state: the rehearsal's bf16 mixed precision (CUDA's) must
    neither meet another test's, nor stay for the tests after it."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def train_on_standin(monkeypatch, tmp_path: Path, preset: str, fuzz: int | None) -> tuple[AsyncCuda, dict, dict]:
    fake = AsyncCuda(fuzz=fuzz)
    fake.install(monkeypatch)
    monkeypatch.setattr(offload, "MIN_BYTES", 1024)
    out = tmp_path / f"runs-{fuzz}"
    with fake.active():
        res = CliRunner().invoke(main, ["train", str(REPO / "presets" / preset), "--set", "train.max_steps=2",
                                        "--set", "train.warmup_steps=0", "--set", "train.checkpoint_every=2",
                                        "--set", f"run.output_dir={out}"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert "done: 2 updates" in res.output
    run_dir = next(out.iterdir())
    (rec_file,) = (run_dir / "records").glob("*-train.json")
    adapter = load_file(run_dir / "adapter" / "pytorch_lora_weights.safetensors")
    return fake, json.loads(rec_file.read_text()), adapter


def same_adapter(a: dict, b: dict) -> None:
    # The same computation in the same order; only when each copy landed differs. A kernel reading a
    # slot or boundary before its copy landed would see another block's bytes (errors of order 1).
    # The tolerance allows for different addresses of the same values (CPU kernels round by alignment).
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("fuzz,seeds", [(3, ()), pytest.param(None, (3, 5, 11), marks=pytest.mark.slow)])
def test_train_tiny_flux_on_the_cuda_path(monkeypatch, tmp_path, fuzz, seeds) -> None:
    """One run (copies landing at random); with --slow, one with each copy landing as late as
    allowed and three fuzzed ones, which must train the same adapter."""
    fake, rec, adapter = train_on_standin(monkeypatch, tmp_path, "tiny-flux.toml", fuzz)
    assert fake.violations == [], fake.violations
    mem = rec["memory"]
    assert mem["swap"]["swapped_blocks"] == 6 and mem["swap"]["host_memory"].keys() == {"registered"}
    assert mem["offload_checkpoints"]["moves"] and mem["offload_checkpoints"]["host_memory"].keys() == {"registered"}
    assert mem["fp8"]["quantized_layers"] > 0
    assert rec["peak_memory"]["peak_allocated"] is not None  # the CUDA statistics were read
    assert rec["setup_peak_memory"]["peak_allocated"] is not None  # set-up's peak, apart from the loop's
    assert rec["status"] == "ok" and rec["steps_done"] == 2
    # the swap engine's copy stream and offload's side stream, beside the compute stream
    assert len({s for e in fake.log if e[0] == "record" for s in [e[2]]}) >= 3
    assert not fake.in_flight
    assert (fake.landed_early > 0) == (fuzz is not None)
    for seed in seeds:
        monkeypatch.undo()
        fuzzed, rec_f, adapter_f = train_on_standin(monkeypatch, tmp_path, "tiny-flux.toml", seed)
        assert fuzzed.violations == [], fuzzed.violations
        assert fuzzed.landed_early > 0  # some copies did land before the wait that ordered them
        same_adapter(adapter, adapter_f)
        assert rec_f["final_loss"] == pytest.approx(rec["final_loss"], rel=1e-4)


@pytest.mark.slow
def test_train_tiny_sdxl_on_the_cuda_path(monkeypatch, tmp_path) -> None:
    fake, rec, adapter = train_on_standin(monkeypatch, tmp_path, "tiny-sdxl.toml", 4)
    assert fake.violations == [], fake.violations
    assert set(fake.host.values()) <= {"pinned"}  # the batches' staging copies; SDXL swaps nothing
    assert rec["status"] == "ok" and rec["steps_done"] == 2 and adapter
    env = rec["environment"]  # the record's device facts, from torch.cuda
    assert (env["device"], env["device_name"], env["device_memory_bytes"]) == ("cuda", "stand-in", fake.total_memory)
    assert rec["memory"] == {}  # no fp8, no swap, no offload in sdxl.toml

"""Data parallelism (several processes through accelerate; gloo between CPU processes here): the
same adapter as one process with the whole batch, the cache filled once, one voice, stops agreed."""

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

from imglora import distributed, record
from imglora.data.batches import Batcher
from imglora.rng import SampleRNG, sample_seed

REPO = Path(__file__).resolve().parents[1]


def run_args(tmp: Path, preset: str, name: str, *extra: str) -> list[str]:
    sets = [f'data.dir="{REPO / "sample_datasets" / "sks_toy"}"', f'cache.dir="{tmp / "cache"}"',
            f'run.output_dir="{tmp / "runs"}"', "train.max_steps=4", "train.warmup_steps=0", "train.log_every=1",
            "train.checkpoint_every=2", f"run.name={name}", *extra]
    if preset == "tiny-llm":
        sets = [s for s in sets if not s.startswith("data.dir")] + [
            f'llm.data_file="{REPO / "sample_datasets" / "chat" / "train.jsonl"}"', "llm.holdout_file=\"\""]
    return ["train", str(REPO / "presets" / f"{preset}.toml"), *[x for s in sets for x in ("--set", s)]]


def imglora(args: list[str], gpus: int = 1, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "imglora", *args, *(["--gpus", str(gpus)] if gpus > 1 else [])]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, **kw)


def losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "log.jsonl").read_text().splitlines() if "loss" in x]


def adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next((run / "adapter").glob("*.safetensors"))))


def assert_same_training(one: Path, two: Path) -> None:
    """The same losses to float32 rounding, and the same adapter up to how Adam amplifies that
    rounding in near-zero gradients (the learning rate bounds each update)."""
    assert losses(one) == pytest.approx(losses(two), rel=1e-5)
    a, b = adapter(one), adapter(two)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=3e-4, rtol=1e-3), (k, (a[k] - b[k]).abs().max())


@pytest.mark.parametrize("preset", ["tiny-sdxl", pytest.param("tiny-flux", marks=pytest.mark.slow),
                                    pytest.param("tiny-llm", marks=pytest.mark.slow)])
def test_two_processes_train_what_one_process_trains_with_the_whole_batch(preset: str, tmp_path: Path) -> None:
    extra = ["memory.blocks_to_swap=4"] if preset == "tiny-flux" else []  # FLUX with block swap on
    if preset == "tiny-llm":
        extra = ["lora.dropout=0"]  # dropout masks are drawn per process (the global RNG), not per sample
    two = imglora(run_args(tmp_path, preset, "two", "train.batch_size=1", *extra), gpus=2)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    one = imglora(run_args(tmp_path, preset, "one", "train.batch_size=2", *extra))
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    runs = tmp_path / "runs"
    assert_same_training(runs / "one", runs / "two")
    rec = record.read_records(runs / "two", "train")
    assert len(rec) == 1 and rec[0]["processes"] == 2 and rec[0]["effective_batch"] == 2  # one writer
    assert rec[0]["gpu_hours"] > 0 and "effective batch 2 = batch 1 x accumulation 1 x 2 processes" in two.stdout
    assert two.stdout.count("done: 4 updates") == 1  # one voice
    if preset != "tiny-llm":
        # The cache was filled by the first run (two processes) exactly once: the main process
        # encoded every entry, the other none; the second run encoded nothing.
        first = rec[0]["cache_encoded"]
        entries = [p for kind in ("latents", "text") for p in (tmp_path / "cache" / kind).rglob("*.safetensors")]
        assert first > 0 and first == len(entries)
        assert record.read_records(runs / "one", "train")[0]["cache_encoded"] == 0


def signal_one_worker(args: list[str], when: str, sig: int) -> tuple[subprocess.Popen, str, float]:
    """Start ``imglora <args> --gpus 2``, wait for the progress line containing ``when``, send ``sig``
    to one of the two workers; returns the launcher, its output so far, and when the signal went."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "imglora", *args, "--gpus", "2"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    out = ""
    for line in p.stdout:
        out += line
        if when in line:
            break
    workers = subprocess.run(["pgrep", "-f", "-P", str(_child_of(p.pid)), "imglora train"], capture_output=True,
                             text=True).stdout.split()
    assert len(workers) == 2, (workers, out[-2000:])
    os.kill(int(workers[-1]), sig)
    return p, out, time.time()


def _child_of(pid: int) -> int:
    """The launcher's agent process (the workers' parent)."""
    for _ in range(100):
        kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        if kids:
            return int(kids[0])
        time.sleep(0.1)
    return pid


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_update_with_one_checkpoint(tmp_path: Path) -> None:
    args = run_args(tmp_path, "tiny-sdxl", "sig", "train.batch_size=1", "train.max_steps=400",
                    "train.checkpoint_every=0")
    p, out, _ = signal_one_worker(args, "3/400", signal.SIGTERM)
    out += p.stdout.read()
    p.wait(timeout=120)
    run = tmp_path / "runs" / "sig"
    ckpts = sorted((run / "checkpoints").glob("step-*"))
    assert len(ckpts) == 1, out[-3000:]
    rec = record.read_records(run, "train")[-1]
    assert rec["interrupted"] and rec["signal"] == "SIGTERM" and rec["steps_done"] == int(ckpts[0].name[5:])
    assert "--gpus 2 --resume" in out


@pytest.mark.slow
def test_a_killed_process_stops_the_run_and_it_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    args = run_args(tmp_path, "tiny-sdxl", "kill", "train.batch_size=1", "train.max_steps=60",
                    "train.checkpoint_every=2")
    p, out, t0 = signal_one_worker(args, "5/60", signal.SIGKILL)
    out += p.stdout.read()
    p.wait(timeout=300)
    assert p.returncode != 0 and time.time() - t0 < 120, out[-3000:]  # all stopped, none left hanging
    run = tmp_path / "runs" / "kill"
    done = sorted(int(c.name[5:]) for c in (run / "checkpoints").glob("step-*"))
    assert done and not (run / "adapter").exists()
    resumed = imglora([*args, "--resume"], gpus=2)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and (run / "adapter").is_dir()


@pytest.mark.slow
def test_resuming_with_another_process_count_is_refused_with_the_reason(tmp_path: Path) -> None:
    one = imglora(run_args(tmp_path, "tiny-sdxl", "r", "train.batch_size=1", "train.max_steps=4"))
    assert one.returncode == 0, one.stderr[-2000:]
    # Make it look unfinished so --resume has something to continue: keep the update-2 checkpoint.
    import shutil

    run = tmp_path / "runs" / "r"
    shutil.rmtree(run / "adapter")
    for c in (run / "checkpoints").glob("step-*"):
        if c.name != "step-000002":
            shutil.rmtree(c)
    two = imglora([*run_args(tmp_path, "tiny-sdxl", "r", "train.batch_size=1", "train.max_steps=4"), "--resume"],
                  gpus=2)
    assert two.returncode != 0
    assert "written by a run of 1 process, this one has 2" in two.stdout + two.stderr


def test_shares_cover_each_batch_once_and_the_draws_do_not_depend_on_the_cut() -> None:
    for n in range(0, 9):
        for world in (1, 2, 3):
            rows = [list(range(n))[distributed.share(n, r, world)] for r in range(world)]
            assert sum(rows, []) == list(range(n)) and max(map(len, rows)) - min(map(len, rows)) <= 1
    seeds = [sample_seed(7, 3, j) for j in range(4)]
    whole = SampleRNG(seeds, "cpu").randn((4, 2, 3), device=torch.device("cpu"))
    halves = [SampleRNG(seeds[:2], "cpu").randn((2, 2, 3), device=torch.device("cpu")),
              SampleRNG(seeds[2:], "cpu").randn((2, 2, 3), device=torch.device("cpu"))]
    assert torch.equal(whole, torch.cat(halves))
    assert len(set(seeds)) == 4 and sample_seed(7, 3, 0) != sample_seed(7, 4, 0)


def test_a_process_without_samples_carries_no_share_and_the_shares_sum_to_one() -> None:
    from imglora.data.samples import Sample  # noqa: F401  (the samples the batcher takes)

    class S:
        def __init__(self, i: int, bucket=(64, 64)) -> None:
            self.bucket, self.repeats, self.regularization, self.caption_dropout = bucket, 1, False, 0.0
            self.variants, self.texts, self.i = [0], [0], i

        def entry(self, v: int, t: int) -> dict[str, torch.Tensor]:
            return {"x": torch.tensor([float(self.i)])}

    b = Batcher([S(0), S(1), S(2)], batch_size=2, seed=0)  # buckets of 3: batches of 2 and 1
    for i in range(b.per_epoch):
        parts = [b.part(i, torch.device("cpu"), r, 2) for r in range(2)]
        n = len(b.ref(i).indices)
        assert sum(p.scale for p in parts) == pytest.approx(1.0)
        assert [len(p.positions) for p in parts] == ([1, 1] if n == 2 else [1, 0])
        assert parts[1].batch is None if n == 1 else parts[1].batch["x"].shape == (1, 1)


@pytest.mark.slow
def test_bench_swap_runs_a_setting_on_two_processes(tmp_path: Path) -> None:
    r = imglora(["bench-swap", str(REPO / "presets" / "tiny-flux.toml"), "--blocks", "fp8:0", "--steps", "2",
                 "--warmup", "1", "--resolution", "64", "--out", str(tmp_path / "b"), "--gpus", "2"], cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert report["processes"] == 2 and report["results"][0]["status"] == "ok"
    assert report["results"][0]["processes"] == 2


def test_shutdown_leaves_the_process_group_before_exit(tmp_path: Path) -> None:
    """The group is torn down by the command, not by destructors at interpreter exit (where gloo's
    threads once aborted a worker that had finished: SIGABRT after the last update)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    assert dist.is_initialized()
    distributed.shutdown(True)
    assert not dist.is_initialized()
    distributed.shutdown(False)  # nothing left to tear down: no error

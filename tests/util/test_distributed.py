"""Data parallelism (several processes through accelerate; gloo between CPU processes here): the
same adapter as one process with the whole batch, the cache filled once, one voice, stops agreed."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from imglora.util import distributed
from imglora.runs import record
from imglora.data.batches import Batcher
from imglora.util.rng import SampleRNG, sample_seed

REPO = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize("preset", [pytest.param("tiny-sdxl", marks=pytest.mark.slow),
                                    pytest.param("tiny-flux", marks=pytest.mark.slow),
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


def start_two(args: list[str], when: str) -> tuple[subprocess.Popen, str]:
    """Start ``imglora <args> --gpus 2`` in a session of its own (so its process group can be
    signalled as a terminal would) and wait for the progress line containing ``when``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "imglora", *args, "--gpus", "2"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    out = ""
    for line in p.stdout:
        out += line
        if when in line:
            break
    return p, out


def workers_of(launcher: subprocess.Popen) -> list[int]:
    """The launcher's two training processes (its children), rank 0 first."""
    pids = subprocess.run(["pgrep", "-f", "-P", str(launcher.pid), "imglora train"], capture_output=True,
                          text=True).stdout.split()
    return sorted(map(int, pids))


def signal_one_worker(args: list[str], when: str, sig: int) -> tuple[subprocess.Popen, str, float, int]:
    """Start ``imglora <args> --gpus 2``, wait for the progress line containing ``when``, send ``sig``
    to one of the two workers; returns the launcher, its output so far, when the signal went, and
    to which process."""
    p, out = start_two(args, when)
    workers = workers_of(p)
    assert len(workers) == 2, (workers, out[-2000:])
    os.kill(workers[-1], sig)
    return p, out, time.time(), workers[-1]


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, to_group", [(signal.SIGTERM, 143, False), (signal.SIGINT, 130, True)])
def test_a_signal_to_the_launcher_or_its_group_stops_every_process_with_one_checkpoint(
        sig: int, code: int, to_group: bool, tmp_path: Path) -> None:
    """SIGTERM to the launcher alone (a scheduler), or Ctrl-C to the whole process group (a terminal):
    the launcher passes it on once to each process, waits for the checkpoint, and exits with their code."""
    args = run_args(tmp_path, "tiny-sdxl", "sig", "train.batch_size=1", "train.max_steps=400",
                    "train.checkpoint_every=0")
    p, out = start_two(args, "2/400")
    (os.killpg if to_group else os.kill)(p.pid, sig)
    out += p.communicate(timeout=120)[0]
    assert p.returncode == code, out[-3000:]
    run = tmp_path / "runs" / "sig"
    ckpts = sorted((run / "checkpoints").glob("step-*"))
    assert len(ckpts) == 1, out[-3000:]
    rec = record.read_records(run, "train")[-1]
    assert rec["interrupted"] and rec["signal"] == signal.Signals(sig).name
    assert rec["steps_done"] == int(ckpts[0].name[5:]) and f"checkpoint {ckpts[0]}" in out
    assert out.count(f"{signal.Signals(sig).name} received") == 1  # the main process's voice, told once
    assert "--gpus 2 --resume" in out and "Traceback" not in out and "Aborted" not in out


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_update_with_one_checkpoint(tmp_path: Path) -> None:
    args = run_args(tmp_path, "tiny-sdxl", "sig", "train.batch_size=1", "train.max_steps=400",
                    "train.checkpoint_every=0")
    p, out, _, _ = signal_one_worker(args, "3/400", signal.SIGTERM)
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
    p, out, t0, killed = signal_one_worker(args, "5/60", signal.SIGKILL)
    out += p.stdout.read()
    p.wait(timeout=300)
    assert p.returncode != 0 and time.time() - t0 < 120, out[-3000:]  # all stopped, none left hanging
    # One line from the launcher naming the process that died, and the survivor's own message; none
    # of torch's launcher tracebacks.
    assert f"imglora: process 1 of 2 (pid {killed}) was killed by SIGKILL; the others stop at their next " \
           "exchange with it" in out, out[-3000:]
    assert "another process of this 2-process run stopped answering" in out and "continue with the same command" in out
    assert "Traceback" not in out and "ChildFailedError" not in out and len(out.splitlines()) < 40, out[-3000:]
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
            self.batch_key, self.preserve = bucket, {}  # (Sample's: one source at most, no preservation captions)

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


WORKER = '''
import os, signal, sys, time
rank, out = int(os.environ["RANK"]), sys.argv[1]
behaviour = sys.argv[2]

def stop(signum, frame):
    with open(f"{out}/{rank}.{signal.Signals(signum).name}", "a") as fh:
        fh.write("x")
    time.sleep(0.3)  # "saving a checkpoint"
    sys.exit(128 + signum)

if behaviour == "checkpoint":
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
elif behaviour == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(f"{out}/{rank}.env", "w").write(" ".join(os.environ[k] for k in ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")))
open(f"{out}/{rank}.ready", "w").close()
if behaviour == "stubborn" and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
'''


@pytest.fixture()
def worker_module(tmp_path: Path, monkeypatch) -> Path:
    (tmp_path / "fake_worker.py").write_text(WORKER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return tmp_path


def launch_and_signal(out: Path, behaviour: str, sig: int | None, lines: list[str]) -> int:
    """``distributed.launch`` of two fake workers; ``sig`` goes to the launcher (this process) once both
    are up, as a scheduler's SIGTERM or a terminal's Ctrl-C would."""
    import threading

    def send() -> None:
        deadline = time.time() + 30
        while not all((out / f"{r}.ready").exists() for r in range(2)) and time.time() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), sig)

    if sig is not None:
        threading.Thread(target=send, daemon=True).start()
    return distributed.launch(2, [str(out), behaviour], module_name="fake_worker", say=lines.append)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_the_launcher_forwards_a_signal_once_to_each_process_and_waits_for_them(sig, code, worker_module) -> None:
    out = worker_module / "out"
    out.mkdir()
    lines: list[str] = []
    t0 = time.time()
    assert launch_and_signal(out, "checkpoint", sig, lines) == code
    name = signal.Signals(sig).name
    assert sorted(p.name for p in out.glob(f"*.{name}")) == [f"0.{name}", f"1.{name}"]
    assert all((out / f"{r}.{name}").read_text() == "x" for r in range(2))  # once each: never a second Ctrl-C
    assert (out / "1.env").read_text() == "2 1 127.0.0.1" and time.time() - t0 < 30 and lines == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the launcher's handlers are given back


def test_a_process_killed_by_a_signal_is_named_in_one_line_and_the_rest_are_stopped(worker_module,
                                                                                   monkeypatch) -> None:
    monkeypatch.setattr(distributed, "GRACE_S", 0.5)
    out = worker_module / "out"
    out.mkdir()
    lines: list[str] = []
    # Process 1 dies of SIGKILL; process 0 ignores SIGTERM (as one stuck in a collective would not
    # act on it): SIGTERM after the grace period, then SIGKILL.
    assert launch_and_signal(out, "stubborn", None, lines) == 128 + signal.SIGKILL
    assert len(lines) == 3 and re.fullmatch(r"imglora: process 1 of 2 \(pid \d+\) was killed by SIGKILL; the others "
                                            r"stop at their next exchange with it", lines[0])
    assert lines[1:] == ["imglora: stopping the processes still running 0 s after process 1 ended",
                         "imglora: killing the processes still running 1 s after process 1 ended"]

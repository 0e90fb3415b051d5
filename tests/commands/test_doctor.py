"""imglora doctor on a machine without a CUDA GPU (this one): it says so, checks host RAM, the
page-locked limit, disk and the model against the preset's plan, and exits 1 with what to change
when the preset cannot run. (The CUDA checks, the registration and the bandwidth probe, run on a GPU
box: tests marked gpu.)"""

from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from imglora.cli import main

REPO = Path(__file__).resolve().parents[2]


def doctor(*args: str):
    return CliRunner().invoke(main, ["doctor", *args], catch_exceptions=False)


def tiny(tmp_path: Path, sample_dataset: Path) -> list[str]:
    data = tmp_path / "data"
    data.mkdir()
    for f in sample_dataset.glob("01_sky.*"):
        shutil.copy(f, data / f.name)
    q = lambda p: json.dumps(str(p))  # noqa: E731
    return [str(REPO / "presets" / "tiny-flux.toml"), "--set", f"data.dir={q(data)}", "--set",
            f"cache.dir={q(tmp_path / 'cache')}", "--set", f"run.output_dir={q(tmp_path / 'runs')}"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's report")
def test_without_a_preset_the_machine_is_described_and_nothing_is_wrong() -> None:
    r = doctor()
    assert r.exit_code == 0, r.output
    assert "GPU" in r.output and "none:" in r.output and "training here runs on the CPU" in r.output
    assert "host RAM" in r.output and "GiB available" in r.output and "ulimit -l:" in r.output
    assert "no preset given: the machine's checks only" in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's report")
def test_a_tiny_preset_is_ready_with_its_plan_disk_and_model(tmp_path: Path, sample_dataset: Path) -> None:
    r = doctor(*tiny(tmp_path, sample_dataset))
    assert r.exit_code == 0, r.output
    assert "model" in r.output and "tiny:flux: on disk" in r.output
    assert "on the CPU:" in r.output and "GiB of host RAM at the peak" in r.output
    assert f"disk (run folder)  {tmp_path / 'runs'}:" in r.output and f"disk (cache)       {tmp_path / 'cache'}:" in r.output
    assert "ready: the preset can run here as it is" in r.output and "PROBLEM" not in r.output


@pytest.mark.slow  # (plans the real FLUX.1 architecture on the meta device: 10 s; CI runs it)
def test_a_missing_model_is_a_problem_naming_the_download(tmp_path: Path) -> None:
    r = doctor(str(REPO / "presets" / "flux.toml"), "--set", f"run.output_dir={json.dumps(str(tmp_path))}",
               "--set", f"cache.dir={json.dumps(str(tmp_path / 'c'))}")
    assert r.exit_code == 1, r.output
    assert "black-forest-labs/FLUX.1-dev: NOT on this machine" in r.output
    assert "PROBLEM: the model is not on disk:" in r.output and "hf download" in r.output
    assert "not ready: fix the problems above" in r.output


def test_a_full_disk_is_a_problem_with_what_to_change(tmp_path: Path, sample_dataset: Path, monkeypatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * 2**30, 10 * 2**30, 2**20))  # 1 MiB free
    r = doctor(*tiny(tmp_path, sample_dataset))
    assert r.exit_code == 1, r.output
    assert f"PROBLEM: {tmp_path / 'cache'} has 0.0 GiB free and the run writes about" in r.output
    assert "point cache.dir at a larger disk" in r.output and "point run.output_dir at a larger disk" in r.output


def test_too_little_host_ram_is_a_problem(tmp_path: Path, sample_dataset: Path, monkeypatch) -> None:
    import psutil

    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=2**20))
    r = doctor(*tiny(tmp_path, sample_dataset))
    assert r.exit_code == 1, r.output
    assert "GiB of host RAM and 0.0 GiB are available: swap fewer blocks, close other processes" in r.output


@pytest.mark.gpu
def test_on_a_gpu_box_the_cuda_checks_run(tmp_path: Path, sample_dataset: Path) -> None:
    r = doctor(*tiny(tmp_path, sample_dataset))
    assert "GPU 0" in r.output and "driver" in r.output and "host->GPU" in r.output and "GB/s" in r.output
    assert "registering 64 MiB" in r.output and "GiB of GPU memory needed" in r.output

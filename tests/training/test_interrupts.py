"""Ctrl-C outside the training loop: while caching (``cache-latents`` and ``train``'s caching
phase) the command exits 130 and says which cache entries were kept; they are reused next time."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-sdxl.toml"


@pytest.fixture()
def many_images(tmp_path: Path) -> list[str]:
    """40 distinct images: enough encoding work that a Ctrl-C lands in the middle of it."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(40):
        Image.frombytes("RGB", (128, 128), os.urandom(128 * 128 * 3)).save(data / f"{i:02d}.png")
        (data / f"{i:02d}.txt").write_text(f"photo number {i}")
    return [f"data.dir={json.dumps(str(data))}", f"cache.dir={json.dumps(str(tmp_path / 'cache'))}",
            f"run.output_dir={json.dumps(str(tmp_path / 'runs'))}", "train.max_steps=2", "train.warmup_steps=0"]


def interrupt_while_caching(command: str, overrides: list[str]) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "imglora", command, str(PRESET),
                             *[x for o in overrides for x in ("--set", o)]], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    out = ""
    for line in proc.stdout:
        out += line
        if "encoding latents: " in line:  # (a progress line every few entries)
            os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
            break
    out += proc.communicate(timeout=120)[0]
    return proc.returncode, out


def entries(cache: Path) -> int:
    return sum(1 for kind in ("latents", "text") for _ in (cache / kind).rglob("*.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("command", ["cache-latents", "train"])
def test_ctrl_c_while_caching_exits_130_and_keeps_what_was_written(command: str, many_images, tmp_path: Path) -> None:
    code, out = interrupt_while_caching(command, many_images)
    assert code == 130, out
    found = re.search(r"error: interrupted while caching: (\d+) of 80 entries were written and are kept in (.+); "
                      r"the rest are encoded next time", out)
    assert found, out
    kept = int(found.group(1))
    assert 1 <= kept < 80 and found.group(2) == str(tmp_path / "cache") and entries(tmp_path / "cache") == kept
    assert "Aborted!" not in out and "Traceback" not in out
    if command == "cache-latents":  # what was kept is reused: only the rest is encoded
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        again = subprocess.run([sys.executable, "-m", "imglora", "cache-latents", str(PRESET),
                                *[x for o in many_images for x in ("--set", o)]], capture_output=True, text=True,
                               env=env, timeout=300)
        assert again.returncode == 0, again.stderr
        reused = re.search(r"latents: (\d+) encoded, (\d+) reused; text: (\d+) encoded, (\d+) reused", again.stdout)
        assert reused and int(reused.group(2)) + int(reused.group(4)) == kept and entries(tmp_path / "cache") == 80

"""Damaged checkpoints on a real tiny SDXL run: flipped bits and truncated adapters are found by
their checksums and skipped for the checkpoint before; a run whose only checkpoint is damaged says
how to start over; --resume of a finished run stops before anything is loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from imglora.training import checkpoint, resume
from imglora.cli import main
from imglora.commands.common import load_config
from imglora.commands.train import train
from imglora.errors import ImgloraError
from imglora.families import registry, sdxl
from imglora.families._shared.diffusers_image import ADAPTER_FILE

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-sdxl.toml"
pytestmark = pytest.mark.usefixtures("one_thread")


def overrides(root: Path, *extra: str) -> list[str]:
    return [f"data.dir={json.dumps(str(root / 'data'))}", f"cache.dir={json.dumps(str(root / 'cache'))}",
            f"run.output_dir={json.dumps(str(root / 'runs'))}", "data.resolution=64", "train.max_steps=6",
            "train.checkpoint_every=2", "train.log_every=1", "train.warmup_steps=2", *extra]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, sample_dataset: Path) -> Path:
    """A finished 6-update run with checkpoints at 2, 4 and 6 (data, cache and runs under one root)."""
    root = tmp_path_factory.mktemp("finished")
    (root / "data").mkdir()
    for name in ("01_sky", "02_grass", "04_wall"):
        for f in sample_dataset.glob(f"{name}.*"):
            shutil.copy(f, root / "data" / f.name)
    train(load_config(PRESET, overrides(root)), out=lambda s: None)
    return root


@pytest.fixture()
def run(finished: Path, tmp_path: Path):
    """A copy of the finished run to damage, and its config."""
    root = tmp_path / "copy"
    shutil.copytree(finished, root, symlinks=True)
    cfg = load_config(PRESET, overrides(root))
    assert [s for s, _ in checkpoint.list_checkpoints(cfg.run_dir)] == [2, 4, 6]
    return cfg


def flip_after_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # header length, header, then the tensors' bytes
    for i in range(start, len(data), 97):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def adapter(folder: Path) -> dict:
    return load_file(str(folder / ADAPTER_FILE))


def test_flipped_bits_in_the_newest_adapter_resume_from_the_one_before_bit_for_bit(run) -> None:
    expected = adapter(run.run_dir / "adapter")
    damaged = checkpoint.step_dir(run.run_dir, 6) / "adapter" / ADAPTER_FILE
    flip_after_header(damaged)
    assert adapter(damaged.parent).keys() == expected.keys()  # still reads as a safetensors file
    lines: list[str] = []
    result = train(run, resume=True, out=lines.append)
    assert any(x.startswith("warning: skipped a damaged checkpoint") and
               f"{damaged} does not match its sha256 in sha256.json" in x for x in lines), lines
    assert any("resuming from" in x and "step-000004" in x for x in lines)
    assert result.steps_done == 6 and not result.interrupted
    # Resumed from update 4: the same adapter as the uninterrupted run (not the damaged weights).
    again = adapter(run.run_dir / "adapter")
    assert all((again[k] == expected[k]).all() for k in expected)


def test_a_truncated_adapter_is_skipped_with_or_without_checksums(run) -> None:
    newest = checkpoint.step_dir(run.run_dir, 6)
    file = newest / "adapter" / ADAPTER_FILE
    whole = file.read_bytes()
    file.write_bytes(whole[: len(whole) // 2])
    state = resume.resume_point(run.run_dir, run, registry)  # nothing loaded yet: the skip is decided here
    assert state["step"] == 4
    assert state["skipped"] == [f"{newest}: {file} is {len(whole) // 2:,} bytes, {len(whole):,} when the checkpoint "
                                "was written (truncated or overwritten)"]
    for _, path in checkpoint.list_checkpoints(run.run_dir):  # as written before checkpoints had checksums
        (path / checkpoint.MANIFEST).unlink()
    lines: list[str] = []
    result = train(run, resume=True, out=lines.append)
    assert any("skipped a damaged checkpoint" in x and f"{file} is not a whole safetensors file" in x for x in lines)
    assert any("step-000004 was written before checkpoints carried checksums (sha256.json), so its files cannot be "
               "verified" in x for x in lines)
    assert any("resuming from" in x and "step-000004" in x for x in lines) and result.steps_done == 6


def test_a_run_whose_only_checkpoint_is_damaged_says_how_to_start_over(run) -> None:
    ckpts = checkpoint.list_checkpoints(run.run_dir)
    for _, path in ckpts[:-1]:
        shutil.rmtree(path)
    only = ckpts[-1][1]
    shutil.rmtree(run.run_dir / "adapter")  # an interrupted run: nothing but its checkpoint
    flip_after_header(only / "optimizer.safetensors")
    expected = (f"{run.run_dir} already holds a run that cannot be resumed: its only checkpoint is damaged "
                f"({only / 'optimizer.safetensors'} does not match its sha256 in sha256.json")
    with pytest.raises(ImgloraError) as exc:
        train(run, out=lambda s: None)
    message = str(exc.value)
    assert message.startswith(expected) and "--resume" not in message
    assert message.endswith(f"Start over under another name (--set run.name=<new name>), or remove this run first: "
                            f"rm -rf {run.run_dir}")
    with pytest.raises(checkpoint.ResumeRefused) as exc:
        train(run, resume=True, out=lambda s: None)
    assert f"{run.run_dir} cannot be resumed: its only checkpoint is damaged" in str(exc.value)
    assert "rm -rf" in str(exc.value)
    assert (only / "optimizer.safetensors").is_file()  # nothing removed for the user


def test_resume_of_a_finished_run_stops_before_loading_anything(run, monkeypatch) -> None:
    def never(*a, **k):
        raise AssertionError("data or the model were loaded for a run that is already complete")

    for name in ("prepare_data", "load_trainable", "load_vae", "load_text_encoders"):
        monkeypatch.setattr(sdxl.SdxlFamily, name, never)
    logging_only = [*overrides(run.run_dir.parents[1]), "train.log_every=3", "train.checkpoint_every=3"]
    res = CliRunner().invoke(main, ["train", str(PRESET), *[x for o in logging_only for x in ("--set", o)],
                                    "--resume"])
    assert res.exit_code == 0, res.output
    assert (f"{run.run_dir} is already complete at 6 updates (adapter: {run.run_dir / 'adapter'}); raise "
            "train.max_steps (or train.epochs) to train further, e.g. --resume --set train.max_steps=12") in res.output
    assert "error" not in res.output and "done:" not in res.output
    longer = load_config(PRESET, [*logging_only, "train.max_steps=8"])
    assert resume.resume_point(longer.run_dir, longer, registry)["step"] == 6  # more updates: resumed as before

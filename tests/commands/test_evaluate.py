"""The separate evaluation pass on tiny SDXL and FLUX runs: images, contact sheet, held-out loss,
loss against step, and an eval record of its own."""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from imglora.commands.common import load_config
from imglora.runs import record
from imglora.cli import eval_cmd
from imglora.data import cache
from imglora.commands.evaluate import evaluate
from imglora.families import get_family
from imglora.models.resolve import resolve_model
from imglora.commands.train import train

REPO = Path(__file__).resolve().parents[2]
IMAGES = ("01_sky", "02_grass", "03_table", "04_wall")  # sorted: 04_wall is the held-out one
PROMPTS = ["sks toy, a striped ball on green grass", "a striped ball on green grass"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """On 2 shared cores OpenMP's second thread mostly waits; one thread is several times faster
    here, and the eval subprocess (OMP_NUM_THREADS) then runs the very same kernels."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        yield
    torch.set_num_threads(n)


def make_data(root: Path, sample_dataset: Path) -> Path:
    data = root / "data"
    data.mkdir()
    for name in IMAGES:
        for f in sample_dataset.glob(f"{name}.*"):
            shutil.copy(f, data / f.name)
    return data


def overrides(root: Path, data: Path, *extra: str) -> list[str]:
    return [f"data.dir={json.dumps(str(data))}", f"cache.dir={json.dumps(str(root / 'cache'))}",
            f"run.output_dir={json.dumps(str(root / 'runs'))}", "data.resolution=64", "train.max_steps=3",
            "train.checkpoint_every=1", "train.keep_checkpoints=3", "train.log_every=1", "train.warmup_steps=0",
            "eval.holdout=1", "eval.sample_steps=2", "eval.strengths=[0, 1]", f"eval.prompts={json.dumps(PROMPTS)}",
            *extra]


@pytest.fixture(scope="module")
def sdxl_run(tmp_path_factory, sample_dataset: Path):
    """A 3-update SDXL run with a checkpoint per update, eval.every = 1 and train.eval_after = true."""
    root = tmp_path_factory.mktemp("sdxl")
    cfg = load_config(REPO / "presets" / "tiny-sdxl.toml",
                      overrides(root, make_data(root, sample_dataset), "train.eval_after=true", "eval.every=1"))
    result = train(cfg, out=lambda s: None)
    return cfg, result


@pytest.fixture(scope="module")
def flux_run(tmp_path_factory, sample_dataset: Path):
    """A 3-update FLUX run trained with the preset's FP8 base and 4 swapped blocks."""
    root = tmp_path_factory.mktemp("flux")
    cfg = load_config(REPO / "presets" / "tiny-flux.toml", overrides(root, make_data(root, sample_dataset)))
    assert cfg.memory.fp8 and cfg.memory.blocks_to_swap == 4
    return cfg, train(cfg, out=lambda s: None)


def pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def base_pipeline_images(family_name: str, prompts: list[str], seed: int, **kwargs) -> list[np.ndarray]:
    """The base model through its own diffusers pipeline, no adapter anywhere; its weights moved to
    aligned memory as imglora's loaders hold them (``imglora.util.owned``: diffusers leaves them in the
    memory-mapped files, where some CPUs' kernels round the last bits otherwise)."""
    import diffusers

    from imglora.util.owned import own_module

    family = get_family(family_name)
    pipe = getattr(diffusers, family.pipeline).from_pretrained(resolve_model(f"tiny:{family_name}", get_family(family_name)).root)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            own_module(component)
    pipe.set_progress_bar_config(disable=True)
    return [np.asarray(pipe(p, height=64, width=64, num_inference_steps=2,
                            generator=torch.Generator().manual_seed(seed), **kwargs).images[0].convert("RGB"))
            for p in prompts]


# ----------------------------------------------------------------------------------------------


@pytest.mark.slow  # (the default run stays under 6 minutes; CI runs it)
def test_eval_after_runs_in_its_own_process_with_its_own_record(sdxl_run) -> None:
    cfg, result = sdxl_run
    assert result.eval_exit_code == 0
    train_rec = record.read_records(cfg.run_dir, "train")[-1]
    eval_rec = record.read_records(cfg.run_dir, "eval")[-1]
    assert train_rec["dataset_items"] == 3  # the held-out image is never trained on, only scored:
    log = [json.loads(line) for line in (cfg.run_dir / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "val_loss" in r] == [1, 2, 3]  # eval.every during training
    # Training's record was complete before the evaluation started, in another process: its peak
    # memory cannot include the evaluation's, which the eval record holds on its own.
    assert datetime.fromisoformat(train_rec["finished"]) <= datetime.fromisoformat(eval_rec["started"])
    assert eval_rec["status"] == "ok" and eval_rec["pid"] != os.getpid()
    for rec in (train_rec, eval_rec):
        assert set(rec["peak_memory"]) >= {"peak_allocated", "peak_reserved", "rss", "peak_rss"}
        assert rec["peak_memory"]["peak_rss"] > 0
    assert eval_rec["seconds"] > 0 and {"loss", "generate", "load_model"} <= set(eval_rec["phases"])
    (loss,) = eval_rec["losses"]
    assert loss["step"] == 3 and loss["heldout"] > 0 and loss["train"] > 0
    assert eval_rec["loss_settings"]["heldout_images"] == 1 and eval_rec["loss_settings"]["train_images"] == 3
    folder = cfg.run_dir / "eval" / "step-000003"
    assert sorted(p.name for p in folder.iterdir()) == ["contact_sheet.png", "p0_s0.png", "p0_s1.png",
                                                        "p1_s0.png", "p1_s1.png"]
    sheet = Image.open(folder / "contact_sheet.png")
    assert sheet.width > 2 * 64 and sheet.height > 2 * 64


@pytest.mark.slow  # (the default run stays under 6 minutes in a fresh clone; CI runs it)
def test_eval_is_deterministic_and_strength_0_is_the_base_pipeline(sdxl_run) -> None:
    cfg, _ = sdxl_run
    folder = cfg.run_dir / "eval" / "step-000003"
    first = {p.name: p.read_bytes() for p in folder.glob("*.png")}  # written by the eval_after process
    result = evaluate(cfg.run_dir, out=lambda s: None)
    assert {p.name: p.read_bytes() for p in folder.glob("*.png")} == first
    first_losses = {k: v for k, v in record.read_records(cfg.run_dir, "eval")[0]["losses"][0].items()
                    if k in ("heldout", "train")}
    assert result.losses[3] == first_losses  # fixed noise: the same figures in another process

    base = base_pipeline_images("sdxl", PROMPTS, seed=0, guidance_scale=7.0)
    for i, expected in enumerate(base):
        np.testing.assert_array_equal(pixels(folder / f"p{i}_s0.png"), expected)
        assert not np.array_equal(pixels(folder / f"p{i}_s1.png"), expected)


@pytest.mark.slow
def test_all_checkpoints_plots_loss_against_step_and_names_the_best(sdxl_run) -> None:
    cfg, _ = sdxl_run
    res = CliRunner().invoke(eval_cmd, [str(cfg.run_dir), "--all-checkpoints", "--strengths", "1", "--seed", "3"])
    assert res.exit_code == 0, res.output
    table = json.loads((cfg.run_dir / "eval" / "losses.json").read_text())
    rows = table["checkpoints"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    best = min(rows, key=lambda r: r["heldout"])["step"]
    assert table["best_step"] == best
    assert f"best checkpoint by held-out loss: update {best}" in res.output
    assert record.read_records(cfg.run_dir, "eval")[-1]["best_step"] == best
    assert (cfg.run_dir / "eval" / "loss_vs_step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all((cfg.run_dir / "eval" / f"step-{s:06d}" / "contact_sheet.png").is_file() for s in (1, 2, 3))
    # A checkpoint's figures do not depend on which others are evaluated with it.
    single = record.read_records(cfg.run_dir, "eval")[0]["losses"][0]
    assert rows[2]["heldout"] == single["heldout"] and rows[2]["train"] == single["train"]


@pytest.mark.slow  # (the default run stays under 6 minutes; CI runs it)
def test_checkpoints_pruned_during_an_all_checkpoints_eval_are_skipped(sdxl_run, tmp_path, monkeypatch) -> None:
    from imglora.training import checkpoint
    from imglora.runs import sheets

    cfg, _ = sdxl_run
    run = tmp_path / "runs" / cfg.run_dir.name
    shutil.copytree(cfg.run_dir, run, ignore=shutil.ignore_patterns("eval"))  # without earlier evaluations' figures
    real = sheets.write_outputs

    def then_prune(folder, *a, **k):  # training goes on meanwhile: a new checkpoint, the oldest kept pruned
        written = real(folder, *a, **k)
        if folder.name == "step-000001":
            checkpoint.remove(checkpoint.step_dir(run, 2))
        return written

    monkeypatch.setattr(sheets, "write_outputs", then_prune)
    lines: list[str] = []
    result = evaluate(run, all_checkpoints=True, strengths=[1.0], out=lines.append)
    assert result.steps == [1, 3] and sorted(result.sheets) == [1, 3]
    assert f"  step 2: skipped: {checkpoint.step_dir(run, 2) / 'adapter'} was removed while this evaluation ran" \
        in "\n".join(lines)
    rows = json.loads((run / "eval" / "losses.json").read_text())["checkpoints"]
    assert [r["step"] for r in rows] == [1, 3]
    assert [r["step"] for r in record.read_records(run, "eval")[-1]["losses"]] == [1, 3]


@pytest.mark.slow
def test_flux_eval_with_other_memory_settings_than_training(flux_run) -> None:
    cfg, _ = flux_run
    plain = ['eval.fp8="off"', "eval.blocks_to_swap=0"]
    a = evaluate(cfg.run_dir, overrides=plain, out=lambda s: None)
    images = [[p.read_bytes() for p in row] for row in a.images[3]]
    b = evaluate(cfg.run_dir, overrides=plain, out=lambda s: None)
    assert [[p.read_bytes() for p in row] for row in b.images[3]] == images
    assert a.losses == b.losses and a.losses[3]["heldout"] > 0
    rec = record.read_records(cfg.run_dir, "eval")[-1]
    assert rec["memory_settings"]["fp8"] is False and rec["memory_settings"]["blocks_to_swap"] == 0

    base = base_pipeline_images("flux", PROMPTS, seed=0, guidance_scale=3.5, max_sequence_length=32)
    for i, expected in enumerate(base):
        np.testing.assert_array_equal(pixels(a.images[3][i][0]), expected)
        assert not np.array_equal(pixels(a.images[3][i][1]), expected)

    # As trained (FP8 base, 4 swapped blocks): runs, and the held-out loss stays close.
    c = evaluate(cfg.run_dir, prompts_file=None, strengths=[1.0], out=lambda s: None)
    rec = record.read_records(cfg.run_dir, "eval")[-1]
    assert rec["memory_settings"]["fp8"] is True and rec["memory"]["swap"]["swapped_blocks"] == 6
    assert c.losses[3]["heldout"] == pytest.approx(a.losses[3]["heldout"], rel=0.05)


# ----------------------------------------------------------------------------------------------


def test_holdout_split_is_the_tail_of_the_sorted_scan(tmp_path: Path, sample_dataset: Path) -> None:
    data = make_data(tmp_path, sample_dataset)
    held_dir = tmp_path / "held"
    held_dir.mkdir()
    for f in sample_dataset.glob("05_sky.*"):
        shutil.copy(f, held_dir / f.name)
    base = load_config(REPO / "presets" / "tiny-sdxl.toml", overrides(tmp_path, data))
    family = get_family("sdxl")
    train_scan, held = cache.split_holdout(base, cache.scan(base, family))
    assert [i.path.stem for i in train_scan.items] == ["01_sky", "02_grass", "03_table"]
    assert [i.path.stem for i in held.items] == ["04_wall"]

    both = load_config(REPO / "presets" / "tiny-sdxl.toml",
                       overrides(tmp_path, data, f"eval.holdout_dir={json.dumps(str(held_dir))}"))
    train_scan, held = cache.split_holdout(both, cache.scan(both, family))
    assert [i.path.stem for i in held.items] == ["04_wall", "05_sky"] and len(train_scan.items) == 3

    too_many = load_config(REPO / "presets" / "tiny-sdxl.toml", overrides(tmp_path, data, "eval.holdout=4"))
    with pytest.raises(Exception, match="leaving none to train on"):
        cache.split_holdout(too_many, cache.scan(too_many, family))


def test_default_prompts_use_captions_with_and_without_the_trigger(tmp_path: Path, sample_dataset: Path) -> None:
    data = make_data(tmp_path, sample_dataset)
    cfg = load_config(REPO / "presets" / "tiny-sdxl.toml", overrides(tmp_path, data, "eval.prompts=[]"))
    # No data.trigger_word: "sks toy" is found as the tag every caption starts with.
    assert get_family("sdxl").default_prompts(cfg) == [
        "sks toy, a striped ball in front of a red brick wall", "a striped ball in front of a red brick wall",
        "sks toy, a striped ball floating in a blue sky", "a striped ball floating in a blue sky"]

"""Changing a run's length on --resume: allowed both ways down to the checkpoint's update, with the
new length's learning-rate schedule from there on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from imglora.training import checkpoint, resume
from imglora.commands.common import load_config
from imglora.families import registry
from imglora.training.step import make_scheduler

REPO = Path(__file__).resolve().parents[2]


def stepped(cfg, total: int, steps: int):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=cfg.train.learning_rate)
    sched = make_scheduler(cfg, opt, total)
    for _ in range(steps):
        opt.step()
        sched.step()
    return opt, sched


def test_a_longer_run_continues_on_the_longer_schedule() -> None:
    cfg = load_config(REPO / "presets" / "tiny-sdxl.toml", ['train.scheduler="cosine"', "train.warmup_steps=2"])
    _, short = stepped(cfg, total=10, steps=10)  # finished: the cosine is at 0
    assert short.get_last_lr()[0] == pytest.approx(0.0)
    opt, longer = stepped(cfg, total=20, steps=0)
    longer.load_state_dict(short.state_dict())
    resume.continue_schedule(opt, longer)
    _, planned = stepped(cfg, total=20, steps=10)  # as if the run had been planned 20 long
    assert opt.param_groups[0]["lr"] == pytest.approx(planned.get_last_lr()[0]) == pytest.approx(
        cfg.train.learning_rate * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * 8 / 18)).item()))
    assert longer.get_last_lr() == [opt.param_groups[0]["lr"]]
    opt.step()
    longer.step()
    planned.optimizer.step()
    planned.step()
    assert longer.get_last_lr()[0] == pytest.approx(planned.get_last_lr()[0])


def test_a_length_below_the_checkpoint_is_refused_before_anything_loads(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = load_config(REPO / "presets" / "tiny-sdxl.toml", [f"run.output_dir={str(tmp_path)!r}", 'run.name="run"'])
    opt, sched = stepped(cfg, total=100, steps=1)
    checkpoint.save(run, 8, write_weights=lambda d: (d / "adapter").mkdir(), optimizer=opt, scheduler=sched,
                    config=cfg.to_dict(), config_hash=cfg.hash(), extra={"total_updates": 100}, keep=3)
    longer = load_config(REPO / "presets" / "tiny-sdxl.toml", [f"run.output_dir={str(tmp_path)!r}", 'run.name="run"',
                                                               "train.max_steps=300"])
    assert resume.resume_point(run, longer, registry)["step"] == 8  # the length alone may change
    shorter = load_config(REPO / "presets" / "tiny-sdxl.toml", [f"run.output_dir={str(tmp_path)!r}", 'run.name="run"',
                                                                "train.max_steps=5"])
    with pytest.raises(checkpoint.ResumeRefused, match="train.max_steps: 5 now, but the checkpoint is at update 8"):
        resume.resume_point(run, shorter, registry)

"""checkpoint.py on its own: what a checkpoint holds, pruning, and which setting changes refuse a resume."""

from __future__ import annotations

from pathlib import Path

import torch

from imglora import checkpoint
from imglora.commands.common import load_config
from imglora.families import registry

REPO = Path(__file__).resolve().parents[1]


def save(run: Path, step: int, keep: int = 3) -> Path:
    p = torch.nn.Parameter(torch.arange(4.0))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(4)
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)

    def write_weights(folder: Path) -> None:
        (folder / "adapter").mkdir(parents=True)
        (folder / "adapter" / "a.safetensors").write_bytes(b"x")

    return checkpoint.save(run, step, write_weights=write_weights, optimizer=opt, scheduler=sched,
                           config={"k": 1}, config_hash="h", extra={"dataset_version": "d", "total_updates": 9},
                           keep=keep)


def test_a_checkpoint_holds_optimizer_state_rng_and_settings_and_loads_back(tmp_path: Path) -> None:
    path = save(tmp_path, 4)
    state = checkpoint.load(path)
    assert state["step"] == 4 and state["config"] == {"k": 1} and state["dataset_version"] == "d"
    exp_avg = state["optimizer_state"]["state"][0]["exp_avg"]
    assert torch.allclose(exp_avg, torch.full((4,), 0.1))  # (1 - beta1) * grad after one step
    assert state["rng"]["torch"].dtype == torch.uint8 and (path / "adapter" / "a.safetensors").is_file()


def test_only_checkpoints_older_than_the_new_one_are_pruned(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        save(tmp_path, step, keep=2)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [6, 8]
    save(tmp_path, 3, keep=2)  # an older update written late (resumed elsewhere): nothing newer goes
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [3, 6, 8]


def test_resume_refuses_only_settings_that_change_what_is_trained() -> None:
    preset = REPO / "presets" / "tiny-flux.toml"
    old = load_config(preset).to_dict()
    safe = load_config(preset, ["train.log_every=7", "run.name=x", "memory.blocks_to_swap=2",
                                "flux.double_blocks_to_swap=-1", "eval.every=3", "cache.dir=\"elsewhere\""])
    assert checkpoint.config_differences(old, safe, registry) == []
    changed = load_config(preset, ["flux.guidance=3.5", "lora.rank=4"])
    assert checkpoint.config_differences(old, changed, registry) == [
        "flux.guidance: 1.0 in the checkpoint, 3.5 now", "lora.rank: 8 in the checkpoint, 4 now"]


def test_a_checkpoint_written_before_keys_moved_still_matches() -> None:
    new = load_config(REPO / "presets" / "tiny-flux.toml")
    old = new.to_dict()
    old["version"] = 1  # as saved by schema 1: the FLUX keys lived in [train] and [memory]
    flux_section = old.pop("flux")
    for key in ("timestep_sampling", "sigmoid_scale", "discrete_flow_shift", "resolution_dependent_shift",
                "loss_weighting", "guidance"):
        old["train"][key] = flux_section[key]
    old["memory"].update(double_blocks_to_swap=-1, single_blocks_to_swap=-1)
    assert checkpoint.config_differences(old, new, registry) == []
    old["train"]["guidance"] = 2.0
    assert checkpoint.config_differences(old, new, registry) == ["flux.guidance: 2.0 in the checkpoint, 1.0 now"]

"""checkpoint.py on its own: what a checkpoint holds, pruning, and which setting changes refuse a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from imglora.training import checkpoint
from imglora.util.hashing import sha256_file
from imglora.commands.common import load_config
from imglora.families import registry

REPO = Path(__file__).resolve().parents[2]


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


def flip_after_header(path: Path, offset: int = 0) -> None:
    """Flip the bits of one byte of a safetensors file's tensor data; the header stays valid."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # the header's length, then the header, then the data
    data[start + offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_every_file_has_its_sha256_written_last_and_a_changed_file_is_a_damaged_checkpoint(tmp_path: Path) -> None:
    path = save(tmp_path, 4)
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == [f for f in files if f != checkpoint.MANIFEST]
    assert manifest["files"]["state.json"] == {"sha256": sha256_file(path / "state.json"),
                                               "bytes": (path / "state.json").stat().st_size}
    assert checkpoint.load(path)["verified"] is True

    flip_after_header(path / "optimizer.safetensors")
    with pytest.raises(checkpoint.DamagedCheckpoint,
                       match=r"optimizer.safetensors does not match its sha256 in sha256.json"):
        checkpoint.load(path)
    assert "optimizer.safetensors does not match" in checkpoint.damage(path)
    flip_after_header(path / "optimizer.safetensors")  # flipped back: whole again
    assert checkpoint.damage(path) is None
    rng = path / "rng.safetensors"
    size = rng.stat().st_size
    rng.write_bytes(rng.read_bytes()[: size // 2])
    with pytest.raises(checkpoint.DamagedCheckpoint,
                       match=rf"rng.safetensors is {size // 2:,} bytes, {size:,} when the checkpoint was written"):
        checkpoint.load(path)
    save(tmp_path, 6)
    (checkpoint.step_dir(tmp_path, 6) / "adapter" / "a.safetensors").unlink()
    with pytest.raises(checkpoint.DamagedCheckpoint, match=r"a.safetensors is missing \(listed in sha256.json\)"):
        checkpoint.load(checkpoint.step_dir(tmp_path, 6))


def test_a_checkpoint_from_before_checksums_loads_unverified_but_a_truncated_file_is_still_found(tmp_path) -> None:
    path = save(tmp_path, 4)
    (path / checkpoint.MANIFEST).unlink()  # as written by an earlier imglora
    (path / "adapter" / "a.safetensors").unlink()
    save_file({"w": torch.ones(64)}, str(path / "adapter" / "a.safetensors"))
    assert checkpoint.load(path)["verified"] is False
    whole = (path / "adapter" / "a.safetensors").read_bytes()
    (path / "adapter" / "a.safetensors").write_bytes(whole[:-10])
    with pytest.raises(checkpoint.DamagedCheckpoint, match=r"adapter/a.safetensors is not a whole safetensors file"):
        checkpoint.load(path)


def test_pruned_checkpoints_leave_nothing_behind(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        save(tmp_path, step, keep=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000006"]

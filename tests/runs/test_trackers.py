"""run.log_with: TensorBoard and wandb (offline: no network) hold what training and the evaluation pass log,
read back with TensorBoard's event reader and from wandb's run files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from imglora.commands.common import load_config
from imglora.commands.evaluate import evaluate
from imglora.commands.train import train

REPO = Path(__file__).resolve().parents[2]
TRAIN_TAGS = {"train/loss", "train/lr", "train/sec_per_update", "train/grad_norm", "train/peak_rss"}


def tensorboard_scalars(folder: Path) -> tuple[dict[str, dict[int, float]], set[str]]:
    """({tag: {step: value}}, image tags) of every event file in ``folder`` (training's and eval's)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    tags = acc.Tags()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in tags["scalars"]}, set(tags["images"])


def wandb_history(run_file: Path) -> list[dict[str, object]]:
    """The history rows of a wandb run file (``run-<id>.wandb``): a 7-byte header, then LevelDB-log
    records (32 KiB blocks; each chunk: crc32, length, type 1 full / 2 first / 3 middle / 4 last)
    holding wandb's protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


@pytest.mark.slow  # (the default run stays under 6 minutes; CI runs it)
def test_tensorboard_and_wandb_hold_training_and_evaluation(small_run) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    cfg = load_config(REPO / "presets" / "tiny-sdxl.toml", [
        *small_run(), 'run.log_with=["tensorboard", "wandb"]', "train.max_steps=3", "train.log_every=1",
        "train.warmup_steps=0", "train.checkpoint_every=0", "eval.holdout=1", "eval.every=1", "train.ema=true",
        "train.ema_decay=0.5", "data.resolution=64", "eval.sample_steps=1", "eval.strengths=[0, 1]",
        'eval.prompts=["sks toy"]'])
    lines: list[str] = []
    train(cfg, out=lines.append)
    run = cfg.run_dir
    logged = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in logged if "loss" in r}
    lrs = {r["step"]: r["lr"] for r in logged if "lr" in r}
    result = evaluate(run, weights="both", out=lines.append)
    assert (run / "eval" / "step-000003" / "p0_ema_s1.png").is_file()  # the moving average's column

    scalars, images = tensorboard_scalars(run / "tensorboard")
    assert TRAIN_TAGS | {"val/loss", "eval/heldout_loss", "eval/train_loss", "eval/heldout_loss_ema"} <= set(scalars)
    for tag in TRAIN_TAGS:
        assert sorted(scalars[tag]) == [1, 2, 3], tag
    assert all(scalars["train/loss"][s] == pytest.approx(v, rel=1e-6) for s, v in losses.items())
    assert scalars["train/lr"] == pytest.approx(lrs, rel=1e-6)
    assert all(v > 0 for v in scalars["train/grad_norm"].values())
    assert scalars["eval/heldout_loss"][3] == pytest.approx(result.losses[3]["heldout"], rel=1e-6)
    assert scalars["eval/heldout_loss_ema"][3] == pytest.approx(result.losses[3]["ema"]["heldout"], rel=1e-6)
    assert "eval/contact_sheet" in images

    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 2  # training, then the evaluation pass: one run id (trackers.json), offline
    ids = {p.name.rsplit("-", 1)[1] for p in offline}
    assert ids == {json.loads((run / "trackers.json").read_text())["wandb"]}
    train_rows = wandb_history(next(offline[0].glob("run-*.wandb")))
    assert [r["train/loss"] for r in train_rows if "train/loss" in r] == pytest.approx(list(losses.values()), rel=1e-6)
    assert all(TRAIN_TAGS <= set(r) for r in train_rows if "train/loss" in r)
    eval_rows = wandb_history(next(offline[1].glob("run-*.wandb")))
    assert any(r.get("eval/update") == 3 and "eval/heldout_loss" in r for r in eval_rows)
    assert any(k.startswith("eval/contact_sheet") for r in eval_rows for k in r)  # an image, stored beside the run
    assert torch.isfinite(torch.tensor(list(scalars["val/loss"].values()))).all()

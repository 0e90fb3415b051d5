"""The resume check the family tests share: a run's copy cut back to an earlier checkpoint (its
adapter, last checkpoint and later log rows removed) and resumed ends as the run did, bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch


def assert_resumes_exactly(cfg: Any, result: Any, out_dir: Path, last: int = 4, kept_logs: int = 2) -> list[float]:
    """Resume a copy of ``cfg``'s finished run (``result``) from before its checkpoint at ``last`` with
    its first ``kept_logs`` log rows: the same adapter tensors and logged losses. Returns the losses."""
    from safetensors.torch import load_file

    from imglora.commands.train import train

    resumed = cfg.replace(run={"output_dir": str(out_dir), "name": "resumed"})
    shutil.copytree(cfg.run_dir, resumed.run_dir)
    shutil.rmtree(resumed.run_dir / "adapter")
    shutil.rmtree(resumed.run_dir / "checkpoints" / f"step-{last:06d}")
    lines = resumed.run_dir / "log.jsonl"
    lines.write_text("".join(x + "\n" for x in lines.read_text().splitlines()[:kept_logs]))
    again = train(resumed, resume=True, out=lambda s: None)
    a, b = load_file(str(result.adapter)), load_file(str(again.adapter))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = lambda run: [json.loads(x)["loss"] for x in (run / "log.jsonl").read_text().splitlines()]  # noqa: E731
    assert losses(resumed.run_dir) == losses(cfg.run_dir)
    return losses(cfg.run_dir)

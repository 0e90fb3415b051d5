"""train.ema: the moving average of the adapter weights, hand-checked, saved beside them, resumed bit
for bit, and chosen by export (--weights)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from imglora.training import checkpoint
from imglora.adapters import inject as lora
from imglora.commands.common import load_config
from imglora.commands.export import export as export_run
from imglora.commands.train import train
from imglora.training.ema import Ema, swapped
from imglora.errors import ImgloraError
from imglora.families import get_family
from imglora.families._shared.diffusers_image import ADAPTER_FILE
from imglora.models.resolve import resolve_model
from imglora.memory.wrap import resolve_swap

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-sdxl.toml"


def test_ema_by_hand() -> None:
    p = torch.nn.Parameter(torch.tensor([0.0, 8.0]))
    ema = Ema([p], decay=0.5)
    for value, want in ((1.0, [0.5, 4.5]), (2.0, [1.25, 3.25]), (3.0, [2.125, 3.125])):
        with torch.no_grad():
            p.fill_(value)
        ema.update([p])
        assert ema.shadow[0].tolist() == want  # 0.5 * ema + 0.5 * weights, exact in binary
    host = Ema([p], decay=0.75, device="cpu")
    with torch.no_grad():
        p.fill_(7.0)
    host.update([p])
    assert host.shadow[0].tolist() == [4.0, 4.0]  # 0.75 * 3 + 0.25 * 7
    with swapped([p], host.shadow):
        assert p.tolist() == [4.0, 4.0]
    assert p.tolist() == [7.0, 7.0]


@pytest.mark.slow
def test_training_keeps_the_average_every_n_updates_and_resumes_it(small_run, tmp_path) -> None:
    """decay 0.5 every 2 updates over 4: ema = 0.5·(0.5·initial + 0.5·weights₂) + 0.5·weights₄,
    with the average kept in host memory."""
    cfg = load_config(PRESET, [*small_run(), "train.max_steps=4", "train.checkpoint_every=2", "train.warmup_steps=0",
                               "train.ema=true", "train.ema_decay=0.5", "train.ema_every=2", "memory.ema_on_cpu=true"])
    train(cfg, out=lambda _: None)
    run = cfg.run_dir
    fam = get_family("sdxl")
    swap = resolve_swap(fam, cfg, resolve_model("tiny:sdxl", fam))
    model = fam.load_trainable(resolve_model("tiny:sdxl", fam), cfg, torch.device("cpu"), torch.float32, swap).model
    lora.inject(model, fam, cfg.lora, cfg.train.seed)
    initial = lora.adapter_state_dict(model)
    w2 = fam.read_adapter(checkpoint.step_dir(run, 2) / "adapter")
    w4 = fam.read_adapter(run / "adapter")
    ema = fam.read_adapter(run / checkpoint.EMA_DIR)
    assert ema.keys() == w4.keys() == initial.keys()
    for k in ema:
        want = 0.5 * (0.5 * initial[k] + 0.5 * w2[k]) + 0.5 * w4[k]
        torch.testing.assert_close(ema[k], want, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(ema[k], w4[k]) for k in ema)
    assert (checkpoint.step_dir(run, 2) / checkpoint.EMA_DIR / ADAPTER_FILE).is_file()

    # export: the average by default (the run kept one), the trained weights on request
    got = export_run(run, out=tmp_path / "ema.safetensors", dtype="fp32")
    assert got.source == run / checkpoint.EMA_DIR / ADAPTER_FILE and got.metadata["imglora.weights"] == "ema"
    raw = export_run(run, out=tmp_path / "raw.safetensors", dtype="fp32", weights="raw")
    assert raw.source == run / "adapter" / ADAPTER_FILE and raw.metadata["imglora.weights"] == "raw"
    assert load_file(str(got.path)).keys() == load_file(str(raw.path)).keys()

    final = {d: load_file(str(run / d / ADAPTER_FILE)) for d in ("adapter", checkpoint.EMA_DIR)}
    shutil.rmtree(checkpoint.step_dir(run, 4))
    for d in final:
        shutil.rmtree(run / d)
    train(cfg, resume=True, out=lambda _: None)
    for d, want in final.items():
        again = load_file(str(run / d / ADAPTER_FILE))
        assert all(torch.equal(want[k], again[k]) for k in want), f"resumed {d} differs"


def test_export_refuses_ema_weights_of_a_run_without_them(tmp_path) -> None:
    from imglora.export.writer import weights_folder

    with pytest.raises(ImgloraError, match="trained without train.ema"):
        weights_folder("ema", {"train": {"ema": False}}, tmp_path)
    assert weights_folder("auto", {"train": {"ema": False}}, tmp_path) == "adapter"

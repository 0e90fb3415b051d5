"""benchmarks/overhead.py: imglora's update against a bare diffusers + peft loop (the same math)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]


def _overhead():
    spec = importlib.util.spec_from_file_location("overhead_bench", REPO / "benchmarks" / "overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shape_change_cost_compares_the_first_update_at_a_shape_with_the_rest() -> None:
    o = _overhead()
    shapes = [(8, 8), (8, 8), (8, 8), (4, 16), (4, 16), (8, 8), (8, 8)]
    times = [1.0, 1.0, 1.2, 3.0, 2.0, 1.5, 1.0]
    out = o.shape_change_cost(times, shapes)
    assert out["8x8"] == {"updates": 5, "median_same_shape_s": 1.0, "median_after_change_s": 1.5,
                          "change_over_same": 1.5}
    assert out["4x16"] == {"updates": 2, "median_same_shape_s": 2.0, "median_after_change_s": 3.0,
                           "change_over_same": 1.5}


def test_fixed_shapes_take_only_the_most_common_bucket() -> None:
    o = _overhead()
    buckets = [(8, 8), (4, 16), (8, 8), (8, 8), (16, 4)]  # per micro-batch, repeating
    batcher = SimpleNamespace(per_epoch=len(buckets), samples=[SimpleNamespace(bucket=b) for b in buckets],
                              ref=lambda i: SimpleNamespace(indices=(i % len(buckets),)))
    steps = o.choose_steps(batcher, "fixed", 6, 1)
    assert steps == [1, 3, 4, 6, 8, 9] and {o.shape_of(batcher, s) for s in steps} == {(8, 8)}
    assert o.choose_steps(batcher, "buckets", 4, 7) == [7, 8, 9, 10]


@pytest.mark.slow
def test_the_bare_loop_computes_imglora_s_loss_and_a_different_one_is_refused(monkeypatch) -> None:
    """Timing two loops is only a measure of overhead if they do the same math: the benchmark
    compares their losses on one batch with the same draws before it times anything."""
    import torch

    from imglora.util import devices
    from imglora.commands.common import family_of, load_config
    from imglora.data.batches import Batcher
    from imglora.models.resolve import resolve_model

    o = _overhead()
    for preset in ("tiny-sdxl", "tiny-flux"):
        path = REPO / "presets" / f"{preset}.toml"
        cfg = load_config(path, o.DEFAULTS + o.FAMILY_DEFAULTS[load_config(path).model.family])
        family, device = family_of(cfg), devices.default_device()
        src = resolve_model(cfg.model, family)
        data = family.prepare_data(cfg, src, device)
        batcher = Batcher(data.samples, 1, cfg.train.seed, collate=family.collate)
        imglora = o.Imglora(cfg, family, src, data, batcher, device)
        bare = o.Bare(cfg, family.name, src, imglora)
        batch = batcher.batch(0, device)
        same = o.check_same_math(imglora, bare, batch)
        assert same["relative_difference"] <= 1e-4 and same["imglora_loss"] > 0, same
        if preset == "tiny-sdxl":  # the bare SDXL loss has the preset's noise offset and min-SNR-γ
            assert cfg.family.noise_offset > 0 and cfg.family.min_snr_gamma > 0
        right = bare.loss
        monkeypatch.setattr(bare, "loss", lambda b: right(b) * 1.001)  # planted: a 0.1 % different loss
        with pytest.raises(SystemExit, match="differs from imglora's .* the comparison would time different math"):
            o.check_same_math(imglora, bare, batch)
        del imglora, bare
        torch.manual_seed(0)


@pytest.mark.slow
def test_the_benchmark_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "oh"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "overhead.py"), "--rounds", "3", "--updates", "1",
                        "--warmup", "1", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads((out / "overhead.json").read_text())
    assert report["family"] == "sdxl" and report["gradient_checkpointing"] is True
    assert report["same_math"]["relative_difference"] <= 1e-4
    assert [m["mode"] for m in report["modes"]] == ["fixed", "buckets"]
    for m in report["modes"]:
        assert len(m["rounds"]) == 3 and all(row["ratio"] > 0 and row["imglora_s"] > 0 for row in m["rounds"])
        assert [row["first"] for row in m["rounds"]] == ["imglora", "bare", "imglora"]  # the order flips
        assert m["shapes"] == ["128x128"]
    assert "shape_change" in report["modes"][1]
    assert (out / "overhead.png").stat().st_size > 1000
    assert "sdxl fixed    ratio median" in r.stdout and "same math:" in r.stdout

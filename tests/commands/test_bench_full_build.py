"""``bench-swap --arch full`` on a GPU: the random full-size model is made on the device block by
block, quantized there with memory.fp8, and the blocks that will be swapped are sent to the host at
once. The same code runs here on the CPU (``BUILD_ON_DEVICE`` widened to "cpu", shrunk
architectures); the ``gpu`` test runs it on CUDA."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from imglora.commands import bench
from imglora.commands.common import load_config
from imglora.families import get_family
from imglora.memory.wrap import resolve_swap

REPO = Path(__file__).resolve().parents[2]
TINY_FLUX = str(REPO / "presets" / "tiny-flux.toml")
TINY_SDXL = str(REPO / "presets" / "tiny-sdxl.toml")

SMALL_FLUX = {"guidance_embeds": True, "num_layers": 2, "num_single_layers": 4, "attention_head_dim": 16,
              "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
              "axes_dims_rope": (4, 6, 6)}


@pytest.fixture()
def small(monkeypatch):
    """Shrunk FLUX and SDXL architectures for ``full_trainable``."""
    from imglora.families import flux, sdxl

    monkeypatch.setattr(flux.model, "FULL_TRANSFORMER", SMALL_FLUX)
    monkeypatch.setattr(sdxl.model, "FULL_UNET", {
        **sdxl.model.FULL_UNET, "block_out_channels": (32, 64, 64), "attention_head_dim": (2, 4, 4),
        "transformer_layers_per_block": (1, 1, 1), "cross_attention_dim": 64, "addition_time_embed_dim": 8,
        "projection_class_embeddings_input_dim": 6 * 8 + 32, "norm_num_groups": 8})


@pytest.fixture()
def on_cpu_too(monkeypatch):
    from imglora.families._shared import diffusers_image

    monkeypatch.setattr(diffusers_image, "BUILD_ON_DEVICE", {"cuda", "cpu"})


@pytest.fixture()
def moves(monkeypatch):
    """Records every ``to_device(module, device)`` call of the part-by-part build."""
    from imglora.memory import fp8

    calls: list[tuple[nn.Module, str]] = []
    real = fp8.to_device

    def record(module, device, **kw):
        calls.append((module, str(device)))
        return real(module, device, **kw)

    monkeypatch.setattr(fp8, "to_device", record)
    return calls


def _qlinear():
    from optimum.quanto.nn import QLinear

    return QLinear


def _flux(device: torch.device, blocks: int, fp8: bool = True):
    cfg = load_config(TINY_FLUX, [f"memory.fp8={'true' if fp8 else 'false'}"])
    family = get_family("flux")
    cfg = cfg.replace(memory={"blocks_to_swap": blocks})
    swap = resolve_swap(family, cfg, lengths=family.full_block_counts(cfg))  # as bench-swap's worker does
    return family.full_trainable(cfg, torch.float32, swap, device)


def test_flux_parts_are_quantized_as_made_and_swapped_blocks_go_to_the_host(small, on_cpu_too, moves) -> None:
    trainable = _flux(torch.device("cpu"), blocks=2)  # kohya's 2 = 1 of 2 double + 2 of 4 single
    model = trainable.model
    names = {id(m): n for n, m in model.named_modules()}
    assert sorted(names[id(m)] for m, d in moves if d == "cpu") == [
        "single_transformer_blocks.2", "single_transformer_blocks.3", "transformer_blocks.1"]
    assert trainable.facts["full_build"] == {"built_on": "cpu", "parts": 6, "quantized_as_built": True,
                                             "left_on_host": 3}
    QLinear = _qlinear()
    for name in ("transformer_blocks", "single_transformer_blocks"):
        for block in getattr(model, name):
            linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
            assert linears and all(isinstance(m, QLinear) for m in linears)
    # Outside the blocks nothing is quantized yet: apply_memory does it with the exclusions.
    assert type(model.x_embedder) is nn.Linear and type(model.proj_out) is nn.Linear
    assert not any(p.requires_grad for p in model.parameters())
    assert not any(t.is_meta for t in model.state_dict().values())
    assert model.transformer_blocks[0].norm1.linear.bias.abs().sum() == 0  # random_init's rule: biases at 0


def test_the_part_by_part_build_is_deterministic(small, on_cpu_too) -> None:
    a, b = (_flux(torch.device("cpu"), blocks=0).model.state_dict() for _ in range(2))
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if hasattr(x, "_data"):  # a quanto weight: its fp8 bytes and scales
            assert torch.equal(x._data.view(torch.uint8), y._data.view(torch.uint8)) and torch.equal(x._scale, y._scale), k
        else:
            assert torch.equal(x, y), k


def test_without_fp8_the_blocks_stay_in_the_model_dtype(small, on_cpu_too, moves) -> None:
    model = _flux(torch.device("cpu"), blocks=4, fp8=False).model  # 4 = 2 double + 4 single: all blocks
    QLinear = _qlinear()
    assert not any(isinstance(m, QLinear) for m in model.modules())
    assert len([1 for _, d in moves if d == "cpu"]) == 6
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_more_blocks_than_the_model_has_fail_before_anything_is_made(small, on_cpu_too) -> None:
    from imglora.errors import ImgloraError

    with pytest.raises(ImgloraError, match="largest valid number"):
        _flux(torch.device("cpu"), blocks=40)


@pytest.mark.parametrize("family", ["flux", "sdxl"])
def test_bench_worker_runs_the_part_by_part_build(family: str, small, on_cpu_too) -> None:
    preset = TINY_FLUX if family == "flux" else TINY_SDXL
    blocks = 4 if family == "flux" else 0
    r = bench.run_setting({"preset": preset, "overrides": ["cache.text_max_length=16"], "precision": "fp8",
                           "blocks": blocks, "steps": 1, "warmup": 1, "resolution": 64, "arch": "full"})
    assert r["status"] == "ok", r
    assert r["full_build"]["quantized_as_built"] and r["full_build"]["built_on"] == "cpu"
    # apply_memory counts the layers quantized while the model was made, and quantizes no more
    # outside the blocks than the exclusions allow.
    assert r["fp8"]["quantized_layers"] > 0
    if family == "flux":
        assert r["full_build"]["left_on_host"] == 6 and r["swap"]["swapped_blocks"] == 6
        assert r["h2d_bytes_per_update"] > 0
    else:
        assert r["full_build"]["parts"] == 7  # 3 down blocks, the mid block, 3 up blocks
        assert any(k.startswith("time_embedding.") for k in r["fp8"]["kept_layers"])  # the exclusions held


@pytest.mark.gpu
def test_cuda_full_flux_build_quantizes_on_the_device_and_keeps_swapped_blocks_on_the_host(small) -> None:
    """On CUDA: the blocks that stay are quantized on the GPU, the swapped ones are quantized and on
    the host, and the device never held more than the kept part plus a block or so."""
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    trainable = _flux(device, blocks=2)
    model = trainable.model
    QLinear = _qlinear()
    swapped = {"transformer_blocks.1", "single_transformer_blocks.2", "single_transformer_blocks.3"}
    for list_name in ("transformer_blocks", "single_transformer_blocks"):
        for i, block in enumerate(getattr(model, list_name)):
            where = "cpu" if f"{list_name}.{i}" in swapped else "cuda"
            for m in block.modules():
                if isinstance(m, nn.Linear):
                    assert isinstance(m, QLinear), f"{list_name}.{i}"
                    w = m.weight
                    assert type(w).__name__ == "WeightQBytesTensor"  # never quanto's Marlin layout
                    assert w._data.device.type == where and w._scale.device.type == where, f"{list_name}.{i}"
            for p in block.parameters():
                assert p.device.type == where and not p.requires_grad
    assert model.x_embedder.weight.device.type == "cuda"
    assert trainable.facts["full_build"]["left_on_host"] == 3
    # The kept blocks in fp8 and the rest in fp32; the largest block in fp32 at most on top.
    kept = torch.cuda.memory_allocated(device) - base
    largest = max(sum(p.numel() * 4 for p in b.parameters()) for b in model.transformer_blocks)
    assert torch.cuda.max_memory_allocated(device) - base <= kept + 2 * largest


def test_the_gpu_checks_bench_command_needs_no_data_or_model(small, on_cpu_too, tmp_path, monkeypatch) -> None:
    """benchmarks/gpu_check.sh runs `bench-swap presets/flux.toml --arch full` where neither the
    preset's dataset nor FLUX.1-dev exists: the worker must not look for them."""
    monkeypatch.chdir(tmp_path)  # no datasets/my_subject, no .imglora/cache here
    r = bench.run_setting({"preset": str(REPO / "presets" / "flux.toml"), "overrides": [], "precision": "fp8",
                           "blocks": 2, "steps": 1, "warmup": 0, "resolution": 64, "arch": "full"})
    assert r["status"] == "ok", r
    assert r["full_build"]["left_on_host"] == 3 and r["swap"]["swapped_blocks"] == 3
    assert not any(tmp_path.iterdir())  # and writes nothing


def test_random_weights_modulate_little_as_a_trained_model_does() -> None:
    """The adaptive norms' modulation of a randomly built FLUX transformer stays small at FLUX.1's
    width (a trained FLUX.1's shifts, scales and gates are of order 0.1-1; with the matrices at one
    they came out near 86, from 3072 positive silu means added up); norm scales one, biases zero."""
    from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle

    from imglora.models.tiny import random_init

    width = 3072  # FLUX.1's: the sum over it is what made the modulation large
    g = torch.Generator().manual_seed(0)
    temb = 0.3 * torch.randn(1, width, generator=g)  # the time/guidance/text embedding's scale at this width
    for cls in (AdaLayerNormZero, AdaLayerNormZeroSingle):
        with torch.device("meta"):
            norm = nn.Module()
            norm.norm1 = cls(width)
        norm = random_init(norm, torch.float32).norm1
        assert torch.all(norm.linear.bias == 0)
        with torch.no_grad():
            modulation = norm.linear(norm.silu(temb))
        assert modulation.abs().max() < 1.0, (cls.__name__, float(modulation.abs().max()))
    rms = nn.Module()
    with torch.device("meta"):
        rms.norm_q = nn.RMSNorm(128)
    assert torch.all(random_init(rms, torch.float32).norm_q.weight == 1)


def test_random_weights_are_the_same_in_every_process() -> None:
    """bench-swap builds the full-size model once per setting, each in a process of its own, and
    compares the settings' losses: on the CPU the weights came from the unseeded global generator,
    so two settings trained different models (losses 3.33 and 3.26 from one spec, seen here)."""
    from imglora.models.tiny import random_init

    def build(seed: int = 0) -> nn.Module:
        with torch.device("meta"):
            m = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 8))
        return random_init(m, torch.float32, seed)

    torch.manual_seed(1)
    a = build()
    torch.manual_seed(2)  # the global generator's state does not matter
    b = build()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(build(2)[0].weight, a[0].weight)  # the seed does
    assert float(a[0].weight.std()) == pytest.approx(0.02, rel=0.25)


@pytest.fixture()
def poisoned():
    """Every allocation torch leaves uninitialised (torch.empty, empty_like, resize_ ...) filled with
    NaN: a read before a write then shows as a NaN loss here, not only on a GPU, whose fresh memory
    holds whatever was there (a CPU's fresh pages are zeros)."""
    from accelerate.state import AcceleratorState

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    assert torch.isnan(torch.empty(4)).all()  # the switch works on this torch
    AcceleratorState._reset_state(True)  # bf16 mixed precision, as on a GPU, not another test's state
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.mark.parametrize("setting", ["fp8:2", "fp8c:2"])
def test_no_uninitialised_memory_is_read_by_the_gpus_path(small, on_cpu_too, poisoned, setting) -> None:
    """The GPU check's path, in process on the CPU: the full architecture (shrunk) made part by part,
    fp8, swapped blocks, offloaded checkpoint boundaries, bf16 autocast, four updates. With every
    uninitialised allocation full of NaN, the losses and gradient norms stay finite (the first H200
    run trained NaN from its second update; this rules out reads of memory never written on every
    path the CPU shares with it)."""
    precision, blocks = setting.split(":")
    r = bench.run_setting({
        "preset": str(REPO / "presets" / "flux.toml"), "setting": setting, "precision": precision,
        "blocks": int(blocks), "compile": False, "steps": 3, "warmup": 1, "resolution": 128, "arch": "full",
        "processes": 1, "detect_anomaly": False,
        "overrides": ['model.dtype="bf16"', 'train.mixed_precision="bf16"', "memory.offload_checkpoints=true",
                      "memory.swap_prefetch=1"]})
    assert r["status"] == "ok", r.get("error")
    assert len(r["losses"]) == 4 and all(math.isfinite(x) and x > 0 for x in r["losses"]), r["losses"]
    assert len(r["grad_norms"]) == 4 and all(math.isfinite(g) and g > 0 for g in r["grad_norms"]), r["grad_norms"]

"""memory.compile = "blocks": regional torch.compile of the transformer blocks.

The fast tests check what is installed without compiling anything. The slow ones (CI runs them)
train with inductor, using the system's C++ compiler. They compile each kind of block once, in
40–90 s on 2 cores with a cold cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from imglora.training import step as loop
from imglora.commands.common import family_of, load_config
from imglora.commands.train import train
from imglora.errors import ConfigError, ImgloraError
from imglora.memory import compile as compiled
from imglora.models.resolve import resolve_model
from loading import tiny_session

REPO = Path(__file__).resolve().parents[2]


def _session(preset: str, *overrides: str) -> loop.Session:
    cfg = load_config(REPO / "presets" / f"{preset}.toml", list(overrides))
    family = family_of(cfg)
    src = resolve_model(cfg.model, family)
    return tiny_session(family, src, cfg, total=4)[0]


def test_the_fp8_forward_for_graphs_is_quantos_math() -> None:
    """The forward fp8 layers take under compilation computes quanto's qbytes_mm (scale × data in
    the scale's dtype, then the matmul); only the bias moves into the matmul, a last-bit rounding
    difference (fp32: 1e-6 relative)."""
    from imglora.memory.fp8 import quantize_fp8

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.GELU(), torch.nn.Linear(48, 32))
    model.requires_grad_(False)
    quantize_fp8(model)
    x = torch.randn(5, 7, 64, requires_grad=True)
    y_quanto = model(x)
    (g_quanto,) = torch.autograd.grad(y_quanto.square().sum(), x)
    assert compiled.prepare_fp8([model]) == (2, 0)
    assert all(m.forward.__func__ is compiled.dequantizing_forward for m in (model[0], model[2]))
    y_ours = model(x)
    (g_ours,) = torch.autograd.grad(y_ours.square().sum(), x)
    assert not torch.equal(y_quanto, torch.zeros_like(y_quanto))
    torch.testing.assert_close(y_ours, y_quanto, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_ours, g_quanto, rtol=1e-6, atol=1e-6)


def test_install_compiles_one_forward_per_block_and_keeps_every_key() -> None:
    """Each FLUX block's forward is compiled (its hooks stay outside); the state dict, and so
    adapters and checkpoints, keep the same keys; fp8 layers get the traceable forward."""
    eager = _session("tiny-flux")
    s = _session("tiny-flux", 'memory.compile="blocks"')
    facts = s.memory.facts["compile"]
    assert facts["kinds"] == {"FluxTransformerBlock": 4, "FluxSingleTransformerBlock": 8} and facts["blocks"] == 12
    assert facts["mode"] == "default" and facts["eager_layers"] == 0
    n_fp8 = eager.memory.facts["fp8"]["quantized_layers"]  # all inside the blocks (the rest is excluded)
    assert n_fp8 > 0 and facts["fp8_layers_in_graph"] == n_fp8
    model = s.model
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        assert "forward" in vars(block) and hasattr(block.forward, "_torchdynamo_orig_callable")
    assert "forward" not in vars(model)  # the model's own call is not compiled
    assert list(model.state_dict()) == list(eager.model.state_dict())


def test_fp8_compute_and_dora_on_fp8_run_between_graphs() -> None:
    s = _session("tiny-flux", 'memory.compile="blocks"', "memory.fp8_compute=true")
    facts = s.memory.facts["compile"]
    assert facts["eager_layers"] == s.memory.facts["fp8"]["quantized_layers"] and facts["fp8_layers_in_graph"] == 0
    d = _session("tiny-flux", 'memory.compile="blocks"', 'lora.type="dora"')
    dora = d.memory.facts["compile"]
    n_dora = sum(1 for m in d.model.modules() if getattr(m, "use_dora", {}).get("default"))
    assert n_dora > 0 and dora["eager_layers"] == n_dora  # each DoRA base once
    assert dora["eager_layers"] + dora["fp8_layers_in_graph"] == d.memory.facts["fp8"]["quantized_layers"]
    both = _session("tiny-flux", 'memory.compile="blocks"', 'lora.type="dora"', "memory.fp8_compute=true")
    f = both.memory.facts["compile"]  # a layer both DoRA's base and fp8 compute's is counted once
    assert f["eager_layers"] == both.memory.facts["fp8"]["quantized_layers"] and f["fp8_layers_in_graph"] == 0


def test_a_machine_without_a_compiler_is_refused_before_anything_compiles(monkeypatch) -> None:
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ImgloraError, match=r'memory.compile = "blocks": torch.compile on the CPU needs a C\+\+ '
                                           r'compiler, and none is on PATH \(apt install g\+\+\); or set '
                                           r'memory.compile = "none"'):
        _session("tiny-flux", 'memory.compile="blocks"')
    monkeypatch.undo()
    found = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
    assert (compiled.toolchain_problem(torch.device("cpu")) is None) == found


def test_sdxl_compiles_its_transformer_and_resnet_blocks() -> None:
    s = _session("tiny-sdxl", 'memory.compile="blocks"')
    kinds = s.memory.facts["compile"]["kinds"]
    assert set(kinds) == {"BasicTransformerBlock", "ResnetBlock2D"} and all(n > 0 for n in kinds.values())


def test_a_family_without_blocks_to_compile_is_refused() -> None:
    with pytest.raises(ConfigError, match=r'memory.compile: compiled blocks are implemented for the sdxl, flux, '
                                          r'flux_kontext, chroma, qwen_image, qwen_image_edit, qwen_image_edit_plus, z_image, flux2, krea2 and qwen_image21 families; set it to "none" for llm'):
        load_config(REPO / "presets" / "tiny-llm.toml", ['memory.compile="blocks"'])
    with pytest.raises(ConfigError, match=r"memory.compile_mode: expected one of 'default', "
                                          r"'max-autotune-no-cudagraphs', got the string \"reduce-overhead\""):
        load_config(REPO / "presets" / "tiny-flux.toml", ['memory.compile_mode="reduce-overhead"'])


# -- compiled for real (slow) ---------------------------------------------------------------------

def _run(small_run, preset: str, name: str, *overrides: str, resume: bool = False):
    base = small_run(("01_sky", "02_grass", "04_wall")) + [
        "train.max_steps=4", "train.warmup_steps=0", "train.log_every=1", "train.checkpoint_every=0",
        "data.resolution=64", f'run.name="{name}"']
    cfg = load_config(REPO / "presets" / f"{preset}.toml", base + list(overrides))
    result = train(cfg, resume=resume, out=lambda s: None)
    rows = [json.loads(line) for line in (result.run_dir / "log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], result


def _adapter(result) -> dict[str, torch.Tensor]:
    return load_file(str(result.adapter))


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    diff = sum(float((a[k].double() - b[k].double()).square().sum()) for k in b)
    return (diff / sum(float(b[k].double().square().sum()) for k in b)) ** 0.5


def _close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) > 0 and all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("preset, extra, rtol", [
    # fp32 on the CPU: inductor fuses and reorders float32 work; the losses agree to 1e-5.
    ("tiny-flux", (), 1e-5),  # fp8 + 4 swapped blocks + offloaded checkpoints + LoRA
    ("tiny-flux", ('lora.type="dora"',), 1e-5),
    ("tiny-flux", ('lora.type="loha"',), 1e-5),
    ("tiny-flux", ('lora.type="lokr"',), 1e-5),
    # fp8 compute's layers run eagerly, unchanged, but they round their inputs to e4m3: a last-bit
    # difference from inductor's fused work before them can flip an element's fp8 rounding
    # (measured: 1.3e-4 over 4 updates on the sample data).
    ("tiny-flux", ("memory.fp8_compute=true",), 1e-3),
    ("tiny-sdxl", (), 1e-5),
    ("tiny-qwen-image", (), 1e-5),  # fp8 + 1 swapped block + offloaded checkpoints, one block kind
])
def test_compiled_blocks_train_what_eager_trains(small_run, preset, extra, rtol) -> None:
    eager, a = _run(small_run, preset, "eager", *extra)
    comp, b = _run(small_run, preset, "compiled", *extra, 'memory.compile="blocks"')
    assert _close(comp, eager, rtol), (comp, eager)
    wa, wb = _adapter(a), _adapter(b)
    assert wa.keys() == wb.keys() and any(v.abs().sum() > 0 for v in wb.values())
    # The adapters as a whole, by the norm of their difference: Adam's first steps move every weight
    # by about the learning rate whatever its gradient's size, so a weight whose gradient is near
    # zero can move either way in the two runs; elementwise tolerances would measure that, not compile.
    assert _relative(wb, wa) <= 100 * rtol, _relative(wb, wa)
    rec = json.loads(b.record.read_text())
    assert rec["memory"]["compile"]["blocks"] > 0 and rec["compile_graphs"]["unique_graphs"] >= 2
    assert rec["compile_graphs"]["frames_compiled"] >= 2
    assert json.loads(a.record.read_text())["compile_graphs"] is None


@pytest.mark.slow
def test_a_compiled_run_resumes_as_it_would_have_continued(small_run) -> None:
    """Compilation changes no key of the checkpoint: a compiled run stopped at update 2 and resumed
    (compiled again in the new session) ends where the uninterrupted compiled run ends. Within
    1e-6: the same compiled kernels on the same shapes, though in another set of graphs."""
    on = 'memory.compile="blocks"'
    whole, w = _run(small_run, "tiny-flux", "whole", on, "train.checkpoint_every=2")
    _run(small_run, "tiny-flux", "cut", on, "train.max_steps=2", "train.checkpoint_every=2")
    resumed, r = _run(small_run, "tiny-flux", "cut", on, "train.checkpoint_every=2", resume=True)
    assert _close(resumed, whole, 1e-6), (resumed, whole)
    assert _relative(_adapter(r), _adapter(w)) <= 1e-4
    # and a checkpoint of a compiled run resumes without compilation
    eager_resumed, _ = _run(small_run, "tiny-flux", "cut", "train.checkpoint_every=2", "train.max_steps=5",
                            resume=True)
    assert len(eager_resumed) == 5 and _close(eager_resumed[:4], whole, 1e-6)

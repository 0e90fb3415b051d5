"""Every adapter type (lora.type) x {sdxl, flux}: trains on the tiny model, resumes bit for bit, exports,
and ComfyUI's loader (``comfy_math``, reimplemented from ComfyUI's source) maps every key and rebuilds the
trained model's merged weight.

The reference weight is peft's own ``merge`` of the trained adapter on a freshly loaded base (the
fp32 weights ComfyUI would patch; the FLUX run trains on an fp8 base with block swapping, the
reference is the unquantized model, as in ComfyUI). ComfyUI's side: ``comfy_math.load_lora`` over a
key map of every Linear/Conv2d weight (ComfyUI's ``model_lora_keys_unet``: ``lora_unet_<path>`` for
SDXL, ``transformer.<path>`` for FLUX), then ``calculate_weight`` on each base weight.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import comfy_math as comfy
from imglora.training import checkpoint
from imglora.adapters import inject as lora
from imglora.commands.common import load_config
from imglora.commands.export import export as export_run
from imglora.commands.train import train
from imglora.families import get_family
from imglora.families._shared.diffusers_image import ADAPTER_FILE
from imglora.models.resolve import resolve_model

REPO = Path(__file__).resolve().parents[2]
KINDS = ("lora", "dora", "loha", "lokr", "oft")
RTOL = 1e-5
# Options that reach every form: alpha != rank; SDXL's tiny preset adapts 3x3 convs too, here with their
# own rank (peft rank/alpha patterns) and, for LoHa/LoKr, the CP (Tucker) form (LoKr's is exported flat).
OPTIONS = {
    "sdxl": ["lora.rank=4", "lora.alpha=6", "lora.conv_rank=2", "lora.conv_alpha=3"],
    "flux": ["lora.rank=4", "lora.alpha=6"],
}
TYPE_OPTIONS = {"loha": ["lora.effective_conv2d=true"], "lokr": ["lora.effective_conv2d=true", "lora.factor=4"],
                # OFT: blocks of 4 outputs, no alpha, no conv rank (one rotation per block, conv layers included)
                "oft": ["lora.rank=4", "lora.alpha=0", "lora.conv_rank=0", "lora.conv_alpha=0"]}
# Resume is checked for two combinations in the default run and for all with --slow.
FAST_RESUME = {("sdxl", "loha"), ("flux", "dora")}


def quiet(_: str) -> None:
    pass


def config(family: str, kind: str, small_run, *extra: str):
    overrides = [*small_run(), "train.max_steps=2", "train.checkpoint_every=1", "train.log_every=1",
                 "train.warmup_steps=0", f'lora.type="{kind}"', *OPTIONS[family],
                 *TYPE_OPTIONS.get(kind, []), *extra]
    return load_config(REPO / "presets" / f"tiny-{family.replace('_', '-')}.toml", overrides)


@dataclass
class Trained:
    family: str
    kind: str
    cfg: object
    run: Path


def trained_run(family: str, kind: str, small_run) -> Trained:
    cfg = config(family, kind, small_run)
    train(cfg, out=quiet)
    return Trained(family, kind, cfg, cfg.run_dir)


# ---------------------------------------------------------------------------------------------
# The reference: the trained adapter merged into the unquantized base by peft
# ---------------------------------------------------------------------------------------------


def base_model(family: str) -> nn.Module:
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel

    fam = get_family(family)
    cls = UNet2DConditionModel if family == "sdxl" else FluxTransformer2DModel
    return cls.from_pretrained(resolve_model(f"tiny:{family}", fam).root, subfolder=fam.denoiser).eval()


def merged_weights(t: Trained) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """({module path: base weight}, {module path: peft's merged weight}) for every adapted module."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    fam = get_family(t.family)
    model = base_model(t.family)
    lora.inject(model, fam, t.cfg.lora, seed=0)
    lora.load_adapter_state(model, fam.read_adapter(t.run / "adapter"))
    base, merged = {}, {}
    for name, m in model.named_modules():
        if isinstance(m, BaseTunerLayer):
            base[name] = m.get_base_layer().weight.detach().clone()
            layer = copy.deepcopy(m)
            layer.merge(safe_merge=True)
            merged[name] = layer.get_base_layer().weight.detach().clone()
    return base, merged


def comfy_key(family: str, module: str) -> str:
    return f"lora_unet_{module.replace('.', '_')}" if family == "sdxl" else f"transformer.{module}"


def comfy_key_map(family: str) -> list[str]:
    """The LoRA key prefixes ComfyUI's model_lora_keys_unet holds for the denoiser's weights."""
    types = (nn.Linear, nn.Conv2d) if family == "sdxl" else (nn.Linear,)
    return [comfy_key(family, n) for n, m in base_model(family).named_modules() if isinstance(m, types)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------

CASES = [(f, k) for f in ("sdxl", "flux") for k in KINDS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sample_dataset):
    """One trained run per (family, type), trained on first use."""
    made: dict[tuple[str, str], Trained] = {}

    def get(family: str, kind: str) -> Trained:
        if (family, kind) not in made:
            root = tmp_path_factory.mktemp(f"{family}-{kind}")

            def small_run(names=("01_sky", "02_grass", "04_wall")):
                data = root / "data"
                data.mkdir(exist_ok=True)
                for name in names:
                    for f in sample_dataset.glob(f"{name}.*"):
                        (data / f.name).write_bytes(f.read_bytes())
                return [f"data.dir={json.dumps(str(data))}", f"cache.dir={json.dumps(str(root / 'cache'))}",
                        f"run.output_dir={json.dumps(str(root / 'runs'))}"]

            made[family, kind] = trained_run(family, kind, small_run)
        return made[family, kind]

    return get


def comfy_case(family: str, kind: str):
    # plain LoRA's export is also checked on synthetic weights by tests/export/test_writer.py
    # (sdxl-lokr in CI only: the default run stays under 6 minutes; flux-lokr stays in it)
    slow = kind == "lora" or (family, kind) in (("sdxl", "lokr"), ("sdxl", "dora"), ("sdxl", "oft"), ("sdxl", "loha"),
                                                  ("flux", "oft"))  # OFT: also tests/adapters/test_oft.py
    return pytest.param(family, kind, marks=(pytest.mark.slow,) if slow else (), id=f"{family}-{kind}")


@pytest.mark.parametrize("family,kind", [comfy_case(f, k) for f, k in CASES])
def test_exported_type_loads_in_comfyui_as_the_trained_merged_weight(runs, family, kind, tmp_path) -> None:
    t = runs(family, kind)
    result = export_run(t.run, out=tmp_path / "x.safetensors", dtype="fp32")
    sd = load_file(str(result.path))
    patches, not_loaded = comfy.load_lora(sd, comfy_key_map(family))
    assert not_loaded == set(), sorted(not_loaded)[:5]
    base, merged = merged_weights(t)
    assert {comfy_key(family, n) for n in merged} == set(patches)
    want_cls = {"lora": comfy.LoRAAdapter, "dora": comfy.LoRAAdapter, "loha": comfy.LoHaAdapter,
                "lokr": comfy.LoKrAdapter, "oft": comfy.OFTAdapter}[kind]
    changed = 0
    for name, want in merged.items():
        adapter = patches[comfy_key(family, name)]
        assert type(adapter) is want_cls
        got = comfy.calculate_weight(adapter, base[name], comfy_key(family, name))
        assert adapter.error is None, adapter.error
        assert rel_err(got, want) <= RTOL, (name, rel_err(got, want))
        changed += not torch.equal(want, base[name])
    assert changed == len(merged)  # training moved every adapted module
    meta = result.metadata
    assert meta["imglora.adapter_type"] == kind
    if family == "flux" and kind != "lora":  # kohya's fused q/k/v form exists for plain LoRA only
        from imglora.errors import ImgloraError

        with pytest.raises(ImgloraError, match=f"only plain LoRA can be; export {kind} with the default format"):
            export_run(t.run, out=tmp_path / "k.safetensors", fmt="kohya")
    if kind in ("loha", "lokr"):
        assert meta["ss_network_module"] == "lycoris.kohya" and json.loads(meta["ss_network_args"])["algo"] == kind
    if kind == "oft":  # no alpha (ComfyUI would read it as a norm constraint); LyCORIS' name for the algorithm
        assert not any(k.endswith(".alpha") for k in sd) and json.loads(meta["ss_network_args"])["algo"] == "diag-oft"


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    # ComfyUI's swap_scale_shift: FLUX's norm_out is (scale, shift) in diffusers, (shift, scale) in BFL
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def test_flux_dora_on_norm_out_swaps_dora_scale_with_the_halves(tmp_path) -> None:
    """ComfyUI maps ``transformer.norm_out.linear`` onto BFL's final adaLN weight, whose halves are
    swapped, with a ``function`` that swaps the patch's halves but not ``dora_scale``'s; so the
    exporter swaps ``dora_scale`` itself. Checked against ComfyUI's math on the BFL-order weight."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer

    from imglora.runs import record

    fam = get_family("flux")
    cfg = load_config(REPO / "presets" / "tiny-flux.toml", ['lora.type="dora"', "lora.rank=2", "lora.alpha=3"])
    model = base_model("flux")
    targets = ["norm_out.linear", "transformer_blocks.0.attn.to_q"]
    peft_cfg = LoraConfig(r=2, lora_alpha=3, target_modules=targets, use_dora=True)
    model.add_adapter(peft_cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(0.5 + torch.rand(p.shape, generator=gen))
            elif lora.is_adapter_parameter(name):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    run = tmp_path / "run"
    fam.save_adapter(model, peft_cfg, run / "adapter")
    rec = record.RunRecord("train", run, cfg.to_dict())
    rec.set(steps_done=1, adapter=str(run / "adapter" / ADAPTER_FILE))
    rec.write()
    sd = load_file(str(export_run(run, out=tmp_path / "x.safetensors", dtype="fp32").path))
    patches, not_loaded = comfy.load_lora(sd, comfy_key_map("flux"))
    assert not_loaded == set() and set(patches) == {f"transformer.{t}" for t in targets}
    for name in targets:
        layer = model.get_submodule(name)
        assert isinstance(layer, BaseTunerLayer)
        w0 = layer.get_base_layer().weight.detach().clone()
        merged_layer = copy.deepcopy(layer)
        merged_layer.merge(safe_merge=True)
        want = merged_layer.get_base_layer().weight.detach()
        if name == "norm_out.linear":  # ComfyUI holds BFL's order and swaps the patch into it
            got = swap_halves(comfy.calculate_weight(patches[f"transformer.{name}"], swap_halves(w0), name,
                                                     function=swap_halves))
            unswapped = dict(sd, **{"transformer.norm_out.linear.dora_scale":
                                    swap_halves(sd["transformer.norm_out.linear.dora_scale"])})
            wrong = comfy.load_lora(unswapped, [f"transformer.{name}"])[0][f"transformer.{name}"]
            bad = swap_halves(comfy.calculate_weight(wrong, swap_halves(w0), name, function=swap_halves))
            assert rel_err(bad, want) > 1e-3  # the swap matters
        else:
            got = comfy.calculate_weight(patches[f"transformer.{name}"], w0, name)
        assert rel_err(got, want) <= RTOL, name


def resume_case(family: str, kind: str):
    marks = () if (family, kind) in FAST_RESUME else (pytest.mark.slow,)
    return pytest.param(family, kind, marks=marks, id=f"{family}-{kind}")


@pytest.mark.parametrize("family,kind", [resume_case(f, k) for f, k in CASES])
def test_resume_is_bit_identical(runs, family, kind) -> None:
    t = runs(family, kind)
    final = load_file(str(t.run / "adapter" / ADAPTER_FILE))
    # Forget the end of the run: the newest checkpoint (update 2) and the adapter; resume from update 1.
    import shutil

    shutil.rmtree(checkpoint.step_dir(t.run, 2))
    shutil.rmtree(t.run / "adapter")
    lines: list[str] = []
    train(t.cfg, resume=True, out=lines.append)
    assert any("resuming from" in x and "step-000001" in x for x in lines)
    again = load_file(str(t.run / "adapter" / ADAPTER_FILE))
    assert final.keys() == again.keys()
    assert all(torch.equal(final[k], again[k]) for k in final), "resumed adapter differs from the uninterrupted one"


def test_each_type_trains_its_own_tensors(runs) -> None:
    suffixes = {"dora": {"lora_A.weight", "lora_B.weight", "lora_magnitude_vector"},
                "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"}}
    for kind, want in suffixes.items():
        keys = load_file(str(runs("sdxl", kind).run / "adapter" / ADAPTER_FILE))
        got = {".".join(k.split(".")[-2 if k.endswith(".weight") else -1:]) for k in keys}
        assert got == want, (kind, got)


@pytest.mark.parametrize("family", ["flux", pytest.param("sdxl", marks=pytest.mark.slow)])  # (6-minute default run)
def test_dora_adapter_loads_in_diffusers_with_the_trained_output(runs, family) -> None:
    """diffusers' load_lora_weights takes the run's DoRA adapter (peft form, with its magnitude and,
    for SDXL, the conv layers' own rank and alpha); LoHa/LoKr it refuses (README's table)."""
    import diffusers

    t = runs(family, "dora")
    fam = get_family(family)
    root = resolve_model(f"tiny:{family}", fam).root
    pipe = getattr(diffusers, fam.pipeline).from_pretrained(root)
    pipe.load_lora_weights(str(t.run / "adapter"))
    loaded = dict(getattr(pipe, fam.denoiser).named_modules())
    _, merged = merged_weights(t)
    for name, want in merged.items():
        layer = copy.deepcopy(loaded[name])
        layer.merge(safe_merge=True)
        assert rel_err(layer.get_base_layer().weight.detach(), want) <= RTOL, name
    loha = runs(family, "loha").run / "adapter"
    with pytest.raises(ValueError, match="LoRA param names contain `'lora'`"):
        getattr(diffusers, fam.pipeline).from_pretrained(root).load_lora_weights(str(loha))

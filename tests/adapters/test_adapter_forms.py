"""peft LoRA/DoRA/LoHa/LoKr/OFT -> ComfyUI form: every key loaded, and ComfyUI's weight == peft's merged weight.

Each case injects one peft adapter (alpha != rank) into a one-layer module, randomizes every
adapter tensor (peft zero-inits one factor, and DoRA's magnitude equals the base norm), exports
it with ``imglora.adapters.forms`` through safetensors, and patches the base weight with the
reimplementation of ComfyUI's math in ``comfy_math``. Ground truth is peft's own ``merge``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from safetensors.torch import load, save
from torch import nn

import comfy_math as comfy
from imglora.adapters import forms as af
from imglora.adapters import oft
from imglora.errors import ImgloraError

PREFIX = "lora_unet_block_0"  # any key in ComfyUI's key map; the module here is "block.0"
MODULE = "block.0"
RTOL = 1e-5
LAYERS: dict[str, Callable[[], nn.Module]] = {
    "linear": lambda: nn.Linear(48, 80),
    "conv3x3": lambda: nn.Conv2d(16, 24, 3, padding=1),
    "conv1x1": lambda: nn.Conv2d(16, 24, 1),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class Case:
    id: str
    kind: str
    layer: str
    make_config: Callable[[], object]
    r: int
    alpha: float
    keys: frozenset[str]          # the peft suffixes this configuration must produce
    rslora: bool = False

    def __str__(self) -> str:
        return self.id


def lora_cfg(r, alpha, **kw):
    from peft import LoraConfig

    return lambda: LoraConfig(r=r, lora_alpha=alpha, target_modules=[MODULE], **kw)


def loha_cfg(r, alpha, **kw):
    from peft import LoHaConfig

    return lambda: LoHaConfig(r=r, alpha=alpha, target_modules=[MODULE], **kw)


def lokr_cfg(r, alpha, **kw):
    from peft import LoKrConfig

    return lambda: LoKrConfig(r=r, alpha=alpha, target_modules=[MODULE], **kw)


def oft_cfg(block):
    from peft import OFTConfig

    return lambda: OFTConfig(r=0, oft_block_size=block, target_modules=[MODULE], use_cayley_neumann=False)


LORA = frozenset({"lora_A.weight", "lora_B.weight"})
DORA = LORA | {"lora_magnitude_vector"}
LOHA = frozenset({"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"})
LOHA_CP = LOHA | {"hada_t1", "hada_t2"}
KR_FULL = frozenset({"lokr_w1", "lokr_w2"})
KR_W2_LOW = frozenset({"lokr_w1", "lokr_w2_a", "lokr_w2_b"})
KR_BOTH_LOW = frozenset({"lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b"})


def _cases() -> list[Case]:
    cases = []
    for layer in LAYERS:
        cases += [
            Case(f"lora-{layer}", "lora", layer, lora_cfg(4, 6.0), 4, 6.0, LORA),
            Case(f"lora-rslora-{layer}", "lora", layer, lora_cfg(4, 6.0, use_rslora=True), 4, 6.0, LORA, rslora=True),
            Case(f"dora-{layer}", "dora", layer, lora_cfg(4, 6.0, use_dora=True), 4, 6.0, DORA),
            Case(f"loha-{layer}", "loha", layer, loha_cfg(4, 6.0, use_effective_conv2d=True), 4, 6.0,
                 LOHA_CP if layer == "conv3x3" else LOHA),  # peft turns the CP form off for 1x1
        ]
    # LoKr. Linear 48->80 factorizes as out (8, 10), in (6, 8); Conv 16->24 as out (4, 6), in (4, 4).
    # peft: w1 full unless decompose_both and r < max(out_l, in_m)/2; w2 full iff r >= max(out_k, in_n)/2.
    cases += [
        # both factors full: ComfyUI ignores .alpha, the scale is folded into lokr_w1
        Case("lokr-both-full-linear", "lokr", "linear", lokr_cfg(6, 4.0), 6, 4.0, KR_FULL),
        Case("lokr-both-full-conv3x3", "lokr", "conv3x3", lokr_cfg(4, 6.0, use_effective_conv2d=True), 4, 6.0, KR_FULL),
        Case("lokr-both-full-conv1x1", "lokr", "conv1x1", lokr_cfg(4, 6.0), 4, 6.0, KR_FULL),
        # w1 full, w2 low-rank (peft's default shape for small ranks)
        Case("lokr-w2-low-linear", "lokr", "linear", lokr_cfg(2, 5.0), 2, 5.0, KR_W2_LOW),
        Case("lokr-w2-low-cp-conv3x3", "lokr", "conv3x3", lokr_cfg(2, 5.0, use_effective_conv2d=True), 2, 5.0,
             KR_W2_LOW | {"lokr_t2"}),
        Case("lokr-w2-low-flat-conv3x3", "lokr", "conv3x3", lokr_cfg(2, 5.0, use_effective_conv2d=False), 2, 5.0,
             KR_W2_LOW),
        Case("lokr-w2-low-conv1x1", "lokr", "conv1x1", lokr_cfg(2, 5.0, use_effective_conv2d=True), 2, 5.0, KR_W2_LOW),
        # both factors low-rank (decompose_both)
        Case("lokr-decomposed-linear", "lokr", "linear", lokr_cfg(2, 3.0, decompose_both=True), 2, 3.0, KR_BOTH_LOW),
        Case("lokr-decomposed-cp-conv3x3", "lokr", "conv3x3",
             lokr_cfg(1, 3.0, decompose_both=True, use_effective_conv2d=True), 1, 3.0, KR_BOTH_LOW | {"lokr_t2"}),
        Case("lokr-decomposed-conv1x1", "lokr", "conv1x1", lokr_cfg(1, 3.0, decompose_both=True), 1, 3.0, KR_BOTH_LOW),
        # LoHa on a 3x3 conv without the CP form: flat (out, in*kh*kw) factors
        Case("loha-flat-conv3x3", "loha", "conv3x3", loha_cfg(4, 6.0, use_effective_conv2d=False), 4, 6.0, LOHA),
    ]
    # OFT (imglora.adapters.oft: peft's rotation applied to the outputs), blocks of 4 and of 8 outputs
    cases += [Case(f"oft-{b}-{layer}", "oft", layer, oft_cfg(b), b, 0.0, frozenset({"oft_R.weight"}))
              for layer in LAYERS for b in (4, 8)]
    return cases


CASES = _cases()


@dataclass
class Trained:
    case: Case
    w0: torch.Tensor                # base weight before merging
    merged: torch.Tensor            # peft's merged weight
    state: dict[str, torch.Tensor]  # get_peft_model_state_dict


def train(case: Case, seed: int = 0) -> Trained:
    """Inject the adapter, randomize every adapter tensor, merge with peft."""
    from peft import get_peft_model_state_dict, inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    torch.manual_seed(seed)
    model = nn.Module()
    model.block = nn.Sequential(LAYERS[case.layer](), nn.Identity())
    w0 = model.block[0].weight.detach().clone()
    config = case.make_config()
    model = inject_adapter_in_model(config, model)
    if case.kind == "oft":  # the rotation moved to the output side, as lora.inject does
        oft.convert(model, config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:  # DoRA magnitude: peft sets it to ‖W0‖; make it trained-looking
                p.mul_(0.5 + torch.rand(p.shape, generator=gen))
            elif any(s in name for s in (".lora_", ".hada_", ".lokr_", ".oft_")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    assert {k[len(MODULE) + 1:] for k in state} == case.keys, sorted(state)
    merged_model = copy.deepcopy(model)
    layer = merged_model.block[0]
    assert isinstance(layer, BaseTunerLayer)
    layer.merge(safe_merge=True)
    merged = layer.get_base_layer().weight.detach().clone()
    assert not torch.equal(merged, w0)
    return Trained(case, w0, merged, state)


def read(t: Trained) -> af.Module:
    c = t.case
    return af.read_peft_module(t.state, MODULE, c.kind, c.alpha, c.r, use_rslora=c.rslora)


def exported(t: Trained) -> dict[str, torch.Tensor]:
    """The module's ComfyUI tensors under PREFIX, through a safetensors round trip."""
    tensors = af.comfy_tensors(read(t), t.w0)
    return load(save({f"{PREFIX}.{k}": v for k, v in tensors.items()}))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.fixture(scope="module", params=CASES, ids=str)
def trained(request) -> Trained:
    return train(request.param)


# ---------------------------------------------------------------------------------------------
# (a) ComfyUI's weight == peft's merged weight; (b) every key loaded
# ---------------------------------------------------------------------------------------------


def test_comfyui_loads_every_key(trained) -> None:
    sd = exported(trained)
    assert comfy.keys_not_loaded(sd, PREFIX) == set()
    patches, _ = comfy.load_lora(sd, [PREFIX])
    want = {"lora": comfy.LoRAAdapter, "dora": comfy.LoRAAdapter, "loha": comfy.LoHaAdapter,
            "lokr": comfy.LoKrAdapter, "oft": comfy.OFTAdapter}[trained.case.kind]
    assert type(patches[PREFIX]) is want


def test_comfyui_weight_equals_peft_merged_weight(trained) -> None:
    sd = exported(trained)
    got = comfy.patched_weight(sd, PREFIX, trained.w0)
    assert got.shape == trained.merged.shape and got.dtype == torch.float32
    assert rel_err(got, trained.merged) < RTOL
    # the change itself, not only the weight it is added to
    assert rel_err(got - trained.w0, trained.merged - trained.w0) < RTOL


def test_comfyui_strength_scales_the_change(trained) -> None:
    # LoraLoader strength s: W0 + s·scale·Δ (LoRA, LoHa, LoKr); W0 + s·(W_dora − W0) (DoRA)
    sd = exported(trained)
    got = comfy.patched_weight(sd, PREFIX, trained.w0, strength=0.37)
    # OFT: ComfyUI scales the rotation's change by the strength twice, W0 + s²·(W_oft − W0)
    s = 0.37 ** 2 if trained.case.kind == "oft" else 0.37
    want = trained.w0 + s * (trained.merged - trained.w0)
    assert rel_err(got - trained.w0, want - trained.w0) < RTOL


def test_delta_is_pefts_merged_change(trained) -> None:
    m = read(trained)
    d = af.delta(m, trained.w0)
    assert d.shape == trained.w0.shape
    assert rel_err(d, trained.merged - trained.w0) < RTOL
    if trained.case.kind not in ("dora", "oft"):  # without a base weight: the shape from `shape=` or the tensors
        shaped = af.read_peft_module(trained.state, MODULE, m.kind, m.alpha, m.rank, use_rslora=m.use_rslora,
                                     shape=trained.w0.shape)
        assert torch.equal(af.delta(shaped), d)


# ---------------------------------------------------------------------------------------------
# (c) LoKr: both factors full vs low-rank
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [c for c in CASES if c.kind == "lokr"], ids=str)
def test_lokr_alpha_only_where_comfyui_reads_it(case) -> None:
    t = train(case)
    m = read(t)
    sd = af.comfy_tensors(m, t.w0)
    both_full = case.keys == KR_FULL
    assert ("alpha" in sd) is not both_full
    if both_full:  # peft's alpha / r lives in lokr_w1
        assert torch.allclose(sd["lokr_w1"], t.state[f"{MODULE}.lokr_w1"] * (case.alpha / case.r))
        assert torch.equal(sd["lokr_w2"], t.state[f"{MODULE}.lokr_w2"])
        # Writing the factors as they are with an .alpha would be off by alpha / r in ComfyUI.
        naive = {f"{PREFIX}.{k}": t.state[f"{MODULE}.{k}"] for k in case.keys} | {
            f"{PREFIX}.alpha": torch.tensor(case.alpha)}
        wrong = comfy.patched_weight(naive, PREFIX, t.w0)
        assert rel_err(wrong - t.w0, t.merged - t.w0) > 0.1
    else:
        assert sd["alpha"].item() == case.alpha and sd["alpha"].shape == ()
        as_is = case.keys - {"lokr_t2", "lokr_w2_a", "lokr_w2_b"} if "lokr_t2" in case.keys else case.keys
        assert all(torch.equal(sd[k], t.state[f"{MODULE}.{k}"]) for k in as_is)


@pytest.mark.parametrize("case", [c for c in CASES if "lokr_t2" in c.keys], ids=str)
def test_lokr_cp_form_is_exported_flat(case) -> None:
    """ComfyUI's LoKrAdapter passes the CP einsum's non-contiguous w2 to torch.kron, which raises
    "view size is not compatible" (Comfy-Org/ComfyUI#11245): ComfyUI logs an ERROR and leaves the
    layer unpatched. The export writes the same-rank flat pair instead."""
    t = train(case)
    sd = af.comfy_tensors(read(t), t.w0)
    out_k, in_n = t.state[f"{MODULE}.lokr_w2_a"].shape[1], t.state[f"{MODULE}.lokr_w2_b"].shape[1]
    kh, kw = t.w0.shape[2:]
    assert "lokr_t2" not in sd
    assert sd["lokr_w2_a"].shape == (out_k, case.r) and sd["lokr_w2_b"].shape == (case.r, in_n * kh * kw)
    raw = {f"{PREFIX}.{k[len(MODULE) + 1:]}": v for k, v in t.state.items()} | {
        f"{PREFIX}.alpha": torch.tensor(case.alpha)}
    try:  # peft's tensors as they are: an ERROR in ComfyUI with this torch, never silently different
        got = comfy.patched_weight(raw, PREFIX, t.w0)
    except comfy.ComfyError as e:
        assert "view size is not compatible" in str(e)
    else:
        assert rel_err(got - t.w0, t.merged - t.w0) < RTOL


# ---------------------------------------------------------------------------------------------
# (d) DoRA
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", list(LAYERS))
def test_dora_scale_is_output_axis_2d_or_4d(layer) -> None:
    t = train(next(c for c in CASES if c.kind == "dora" and c.layer == layer))
    scale = af.comfy_tensors(read(t), t.w0)["dora_scale"]
    out = t.w0.shape[0]
    assert scale.shape == ((out, 1) if layer == "linear" else (out, 1, 1, 1))
    assert scale.dim() == t.w0.dim() and scale.dtype == torch.float32
    # peft's 1-D (out,) magnitude would broadcast to (out, out) in ComfyUI (Comfy-Org/ComfyUI#12938):
    # an ERROR and an unpatched layer for this non-square weight.
    one_d = exported(t) | {f"{PREFIX}.dora_scale": scale.reshape(-1)}
    with pytest.raises(comfy.ComfyError):
        comfy.patched_weight(one_d, PREFIX, t.w0)


@pytest.mark.parametrize("layer", list(LAYERS))
def test_dora_scale_compensates_comfyuis_original_weight_norm(layer) -> None:
    """ComfyUI divides by ‖W0‖, peft by ‖W0 + sΔ‖: peft's plain magnitude is wrong in ComfyUI, the
    exported (compensated) one is exact; with the open PR's normalisation the plain one would be."""
    t = train(next(c for c in CASES if c.kind == "dora" and c.layer == layer))
    sd = exported(t)
    out = t.w0.shape[0]
    plain = dict(sd)
    plain[f"{PREFIX}.dora_scale"] = t.state[f"{MODULE}.lora_magnitude_vector"].reshape(out, *[1] * (t.w0.dim() - 1))
    assert rel_err(comfy.patched_weight(plain, PREFIX, t.w0) - t.w0, t.merged - t.w0) > 1e-2
    assert rel_err(comfy.patched_weight(sd, PREFIX, t.w0) - t.w0, t.merged - t.w0) < RTOL


def test_dora_needs_the_base_weight() -> None:
    t = train(next(c for c in CASES if c.id == "dora-linear"))
    m = read(t)
    with pytest.raises(ImgloraError, match="base weight"):
        af.comfy_tensors(m, None)
    with pytest.raises(ImgloraError, match="base weight"):
        af.delta(m)


def test_peft_dora_keys_as_they_are_lose_the_magnitude_in_comfyui() -> None:
    # ComfyUI reads peft's lora_A/lora_B but not lora_magnitude_vector: the check sees it.
    t = train(next(c for c in CASES if c.id == "dora-linear"))
    assert comfy.keys_not_loaded(t.state, MODULE) == {f"{MODULE}.lora_magnitude_vector"}


# ---------------------------------------------------------------------------------------------
# Reading peft's state dict
# ---------------------------------------------------------------------------------------------


def test_read_peft_module_refuses_what_does_not_fit() -> None:
    t = train(next(c for c in CASES if c.id == "dora-linear"))
    with pytest.raises(ImgloraError, match="use kind 'dora'"):
        af.read_peft_module(t.state, MODULE, "lora", 6.0, 4)
    with pytest.raises(ImgloraError, match="rank 8 given"):
        af.read_peft_module(t.state, MODULE, "dora", 6.0, 8)
    with pytest.raises(ImgloraError, match="no adapter tensors"):
        af.read_peft_module(t.state, "block.1", "dora", 6.0, 4)
    named = {k.replace("lora_A.weight", "lora_A.default.weight"): v for k, v in t.state.items()}
    with pytest.raises(ImgloraError, match="adapter name"):
        af.read_peft_module(named, MODULE, "dora", 6.0, 4)
    partial = {k: v for k, v in t.state.items() if "lora_B" not in k}
    with pytest.raises(ImgloraError, match="without"):
        af.read_peft_module(partial, MODULE, "dora", 6.0, 4)
    with pytest.raises(ImgloraError, match="does not fit the base weight"):
        af.read_peft_module(t.state, MODULE, "dora", 6.0, 4, shape=(80, 47))


def test_other_modules_in_the_state_dict_are_not_mixed_in() -> None:
    t = train(next(c for c in CASES if c.id == "loha-linear"))
    state = dict(t.state) | {f"{MODULE}.sub.hada_w1_a": torch.zeros(1), f"{MODULE}0.hada_w1_a": torch.zeros(1)}
    m = af.read_peft_module(state, MODULE, "loha", 6.0, 4)
    assert set(m.tensors) == LOHA


# ---------------------------------------------------------------------------------------------
# diffusers' load_lora_weights (SDXL): which exported types it takes
# ---------------------------------------------------------------------------------------------


def test_diffusers_sdxl_loader_takes_lora_drops_dora_scale_refuses_loha_lokr() -> None:
    """``StableDiffusionXLLoraLoaderMixin.lora_state_dict`` is the first step of ``load_lora_weights``."""
    from diffusers.loaders.lora_pipeline import StableDiffusionXLLoraLoaderMixin as Loader

    x = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q"
    files = {}
    for case_id in ("lora-linear", "dora-linear", "loha-linear", "lokr-w2-low-linear"):
        t = train(next(c for c in CASES if c.id == case_id))
        files[case_id] = {f"{x}.{k}": v for k, v in af.comfy_tensors(read(t), t.w0).items()}
    for case_id in ("lora-linear", "dora-linear"):
        sd = Loader.lora_state_dict(files[case_id])[0]
        assert len(sd) == 2 and all(k.startswith("unet.") for k in sd)  # up and down; alpha folded in
        assert not any("dora_scale" in k for k in sd)                    # DoRA: silently plain LoRA
    for case_id in ("loha-linear", "lokr-w2-low-linear"):
        with pytest.raises(ValueError, match="not been correctly renamed"):
            Loader.lora_state_dict(files[case_id])
    # peft's own DoRA form (what imglora saves for diffusers) keeps its magnitude
    t = train(next(c for c in CASES if c.id == "dora-linear"))
    peft_form = {f"unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.{k[len(MODULE) + 1:]}": v
                 for k, v in t.state.items()}
    sd = Loader.lora_state_dict(peft_form)[0]
    assert any(k.endswith("lora_magnitude_vector") for k in sd)


def test_case_list_covers_every_type_and_layer() -> None:
    assert {(c.kind, c.layer) for c in CASES} >= {(k, l) for k in af.KINDS for l in LAYERS}
    assert all(c.alpha != c.r for c in CASES)


def test_oft_is_orthogonal_writes_no_alpha_and_needs_the_base_weight() -> None:
    t = train(next(c for c in CASES if c.id == "oft-8-linear"))
    m = read(t)
    sd = af.comfy_tensors(m, t.w0)
    assert set(sd) == {"oft_blocks"} and sd["oft_blocks"].shape == (10, 8, 8)  # 80 outputs in blocks of 8
    # Each block of 8 rows is rotated (W_b -> Rᵀ W_b, R orthogonal): the block's W_bᵀ W_b is kept, to
    # fp32 rounding of the Cayley solve and the product.
    w0, w1 = t.w0.unflatten(0, (10, 8)), t.merged.unflatten(0, (10, 8))
    torch.testing.assert_close(w1.transpose(1, 2) @ w1, w0.transpose(1, 2) @ w0, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(w1, w0, atol=1e-3)
    with pytest.raises(ImgloraError, match="an OFT delta depends on the base weight"):
        af.delta(m)
    with pytest.raises(ImgloraError, match="block size 4 given, the rotation's blocks are 8 wide"):
        af.read_peft_module(t.state, MODULE, "oft", 0.0, 4)
    assert math.isclose(af.Module("m", "lora", {}, 6.0, 4, use_rslora=True).scaling, 3.0)

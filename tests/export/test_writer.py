"""Export: key forms ComfyUI maps completely, exact deltas, diffusers loading, ComfyUI folders, workflows.

"ComfyUI maps every key" is checked by ``comfy_load`` below, which reproduces ComfyUI's
``comfy.lora.load_lora`` (ComfyUI's key mapping) against a key map derived from the model's own
module list; the fused FLUX form is checked through diffusers' independent BFL -> diffusers converter.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import re
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from comfy_tree import fake_comfyui

from imglora.families._shared.diffusers_image import ADAPTER_FILE
from imglora.commands.common import load_config
from imglora.export import writer as ex
from imglora.adapters import inject as lora
from imglora.runs import record
from imglora.commands.export import export as export_run
from imglora.families.flux import keys as flux_keys
from imglora.families.sdxl import keys as sdxl_keys
from imglora.errors import ImgloraError
from imglora.families import get_family
from imglora.models.resolve import resolve_model

REPO = Path(__file__).resolve().parents[2]
TRIGGER = "sks toy"


# ---------------------------------------------------------------------------------------------
# Runs with trained-looking adapters (random A and B, so every delta is non-zero)
# ---------------------------------------------------------------------------------------------


def base_model(family: str):
    from diffusers import (ChromaTransformer2DModel, FluxTransformer2DModel, QwenImageTransformer2DModel,
                           UNet2DConditionModel)

    cls = {"sdxl": UNet2DConditionModel, "chroma": ChromaTransformer2DModel, "qwen_image": QwenImageTransformer2DModel,
           "qwen_image_edit_plus": QwenImageTransformer2DModel}.get(family, FluxTransformer2DModel)
    return cls.from_pretrained(resolve_model(f"tiny:{family}", get_family(family)).root, subfolder=get_family(family).denoiser).eval()


def randomize_lora(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def make_run(root: Path, family: str, *, rank: int, alpha: float, targets: list[str] | None = None,
             peft_targets: list[str] | None = None, name: str = "toy", extra: tuple[str, ...] = ()) -> tuple[Path, nn.Module]:
    """A run folder as `imglora train` leaves it: adapter/, checkpoints/step-000010/, records/."""
    overrides = [f"lora.rank={rank}", f"lora.alpha={alpha}", f"data.trigger_word={TRIGGER}", f"run.name={name}",
                 'eval.prompts=["a toy on a wooden table"]', *extra]
    if targets is not None:
        overrides.append(f"lora.targets={json.dumps(targets)}")
    cfg = load_config(REPO / "presets" / f"tiny-{family.replace('_', '-')}.toml", overrides)
    fam = get_family(family)
    model = base_model(family)
    if peft_targets is None:
        peft_cfg = lora.inject(model, fam, cfg.lora, seed=0)
    else:  # modules outside the family's default scope (FLUX globals, norm_out)
        from peft import LoraConfig

        peft_cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=peft_targets)
        model.add_adapter(peft_cfg)
    randomize_lora(model, seed=rank)
    run = root / name
    ckpt = run / "checkpoints" / "step-000010"
    fam.save_adapter(model, peft_cfg, ckpt / "adapter")
    (ckpt / "state.json").write_text(json.dumps({"step": 10, "config": cfg.to_dict()}))
    fam.save_adapter(model, peft_cfg, run / "adapter")
    rec = record.RunRecord("train", run, cfg.to_dict())
    rec.set(steps_done=20, total_updates=20, adapter=str(run / "adapter" / ADAPTER_FILE), dataset_version="d" * 64,
            dataset_items=5, model_dir=str(resolve_model(f"tiny:{family}", get_family(family)).root),
            model_checksums={f"{fam.denoiser}/diffusion_pytorch_model.safetensors": "a" * 64})
    rec.write()
    return run, model


@pytest.fixture(scope="module")
def sdxl_run(tmp_path_factory):
    # alpha != rank; the tiny preset's targets include Conv2d layers (resnets, conv_in, conv_out).
    return make_run(tmp_path_factory.mktemp("sdxl"), "sdxl", rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def flux_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("flux"), "flux", rank=4, alpha=2.0)


@pytest.fixture(scope="module")
def flux_mixed_run(tmp_path_factory):
    """Every Linear of the transformer (globals, modulations, norm_out) except a few fused parts,
    so the fused form has untargeted slices and norm_out's shift/scale swap matters."""
    skip = {"transformer_blocks.0.attn.to_k", "transformer_blocks.1.attn.add_q_proj",
            "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.2.attn.to_q",
            "single_transformer_blocks.2.attn.to_v"}
    targets = [n for n, m in base_model("flux").named_modules() if isinstance(m, nn.Linear) and n not in skip]
    return make_run(tmp_path_factory.mktemp("flux-mixed"), "flux", rank=3, alpha=5.0, peft_targets=targets)


def trained_deltas(model: nn.Module) -> dict[str, torch.Tensor]:
    """peft's own delta ((alpha / rank) · B @ A, reshaped) per adapted module path."""
    return {name: m.get_delta_weight("default").detach() for name, m in model.named_modules()
            if hasattr(m, "lora_A") and "default" in m.lora_A}


# ---------------------------------------------------------------------------------------------
# ComfyUI's loader, reproduced (comfy/lora.py:load_lora + comfy/weight_adapter/lora.py)
# ---------------------------------------------------------------------------------------------

COMFY_PAIRS = [(".lora_up.weight", ".lora_down.weight"), ("_lora.up.weight", "_lora.down.weight"),
               (".lora_B.weight", ".lora_A.weight"), (".lora.up.weight", ".lora.down.weight"),
               (".lora_B", ".lora_A"), (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
               (".lora_B.default.weight", ".lora_A.default.weight")]


def comfy_load(lora_sd: dict[str, torch.Tensor], key_map: dict[str, tuple[str, torch.Size]]):
    """({target: delta at strength 1}, keys ComfyUI would report as "lora key not loaded")."""
    loaded, deltas = set(), {}
    for x, (target, shape) in key_map.items():
        alpha = None
        if f"{x}.alpha" in lora_sd:
            alpha = lora_sd[f"{x}.alpha"].item()
            loaded.add(f"{x}.alpha")
        for up_s, down_s in COMFY_PAIRS:
            if x + up_s in lora_sd:
                up, down = lora_sd[x + up_s].float(), lora_sd[x + down_s].float()
                loaded |= {x + up_s, x + down_s}
                scale = alpha / down.shape[0] if alpha is not None else 1.0
                deltas[target] = (scale * torch.mm(up.flatten(1), down.flatten(1))).reshape(shape)
                break
    return deltas, set(lora_sd) - loaded


def module_key_map(model: nn.Module, key: callable, types=(nn.Linear, nn.Conv2d)) -> dict[str, tuple[str, torch.Size]]:
    return {key(name): (name, m.weight.shape) for name, m in model.named_modules() if isinstance(m, types)}


def sdxl_key_map(unet: nn.Module):
    # ComfyUI accepts lora_unet_<diffusers path _> for every UNet Linear/Conv2d (unet_to_diffusers).
    return module_key_map(unet, lambda n: "lora_unet_" + n.replace(".", "_"))


def flux_key_map(transformer: nn.Module):
    # ComfyUI's Flux branch: transformer.<k> for every Linear of flux_to_diffusers (q/k/v as slices).
    return module_key_map(transformer, lambda n: f"transformer.{n}", types=(nn.Linear,))


def assert_deltas_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], exact: bool = True) -> None:
    """Bit for bit where ComfyUI and peft compute the delta with the same operation (a matrix product
    of up and down, then the scale); a 3x3 (or larger) convolution's delta peft computes as a
    convolution of the down weights by the up weights, ComfyUI as a matrix product: the same sums of
    rank-many products in another order, so within float32 rounding (a few ulps: rtol 1e-6)."""
    assert set(got) == set(want)
    for name, delta in want.items():
        if exact and not (delta.dim() == 4 and delta.shape[-2:] != (1, 1)):
            assert torch.equal(got[name], delta), name
        else:
            torch.testing.assert_close(got[name], delta, rtol=1e-6, atol=1e-8, msg=name)


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors in owned, aligned memory, as ComfyUI computes on a loaded LoRA (not left
    at the file's offsets, where some CPUs' kernels round differently)."""
    from imglora.util.owned import load_file as owned_load

    return owned_load(path)


def header(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as fh:
        return fh.metadata()


# ---------------------------------------------------------------------------------------------
# Key forms and exact deltas
# ---------------------------------------------------------------------------------------------

SDXL_KEY = re.compile(r"^lora_unet_[a-z0-9_]+\.(lora_down\.weight|lora_up\.weight|alpha)$")
FLUX_KEY = re.compile(r"^transformer\.(transformer_blocks|single_transformer_blocks)\.\d+\.[a-z0-9_.]+"
                      r"\.(lora_A\.weight|lora_B\.weight|alpha)$")
FLUX_KOHYA_KEY = re.compile(r"^lora_unet_(double_blocks_\d+_(img|txt)_(attn_qkv|attn_proj|mlp_0|mlp_2|mod_lin)"
                            r"|single_blocks_\d+_(linear1|linear2|modulation_lin)|img_in|txt_in|final_layer_linear"
                            r"|final_layer_adaLN_modulation_1|(time|vector|guidance)_in_(in|out)_layer)"
                            r"\.(lora_down\.weight|lora_up\.weight|alpha)$")


def test_sdxl_export_is_kohya_form_that_comfyui_maps_with_exact_deltas(sdxl_run, tmp_path) -> None:
    run, model = sdxl_run
    res = export_run(run, out=tmp_path / "a.safetensors", dtype="fp32")
    sd = tensors_of(res.path)
    assert res.n_tensors == len(sd) and res.format == "default"
    assert all(SDXL_KEY.match(k) for k in sd), [k for k in sd if not SDXL_KEY.match(k)][:5]
    assert not any("lora_A" in k or "lora_B" in k or k.startswith("unet.") for k in sd)
    assert all(v.dtype == torch.float32 and v.shape == () for k, v in sd.items() if k.endswith(".alpha"))
    assert {v.item() for k, v in sd.items() if k.endswith(".alpha")} == {8.0}  # the trained alpha, rank 4

    deltas, not_loaded = comfy_load(sd, sdxl_key_map(base_model("sdxl")))
    assert not not_loaded, sorted(not_loaded)[:5]
    want = trained_deltas(model)
    assert any(d.dim() == 4 for d in want.values())  # conv LoRAs are part of the check
    assert_deltas_equal(deltas, want)


def test_flux_default_export_maps_in_comfyui_with_exact_deltas(flux_run, tmp_path) -> None:
    run, model = flux_run
    sd = tensors_of(export_run(run, out=tmp_path / "f.safetensors", dtype="fp32").path)
    assert all(FLUX_KEY.match(k) for k in sd), [k for k in sd if not FLUX_KEY.match(k)][:5]
    assert {v.item() for k, v in sd.items() if k.endswith(".alpha")} == {2.0}
    deltas, not_loaded = comfy_load(sd, flux_key_map(base_model("flux")))
    assert not not_loaded, sorted(not_loaded)[:5]
    assert_deltas_equal(deltas, trained_deltas(model))


def test_flux_kontext_export_maps_in_comfyui_as_fluxs_with_exact_deltas(tmp_path) -> None:
    # ComfyUI loads FLUX.1 Kontext [dev] as a FLUX model: the same key map, the same patches.
    run, model = make_run(tmp_path, "flux_kontext", rank=4, alpha=3.0)
    sd = tensors_of(export_run(run, out=tmp_path / "k.safetensors", dtype="fp32").path)
    assert all(FLUX_KEY.match(k) for k in sd), [k for k in sd if not FLUX_KEY.match(k)][:5]
    assert {v.item() for k, v in sd.items() if k.endswith(".alpha")} == {3.0}
    deltas, not_loaded = comfy_load(sd, flux_key_map(base_model("flux_kontext")))
    assert not not_loaded, sorted(not_loaded)[:5]
    assert_deltas_equal(deltas, trained_deltas(model))


def test_chroma_export_maps_in_comfyui_as_fluxs_with_exact_deltas(tmp_path) -> None:
    # ComfyUI's Chroma model is a Flux model (model_base.Chroma(Flux)): its LoRA keys go through the
    # FLUX branch, and every block projection Chroma has is in flux_to_diffusers' table.
    run, model = make_run(tmp_path, "chroma", rank=4, alpha=6.0)
    sd = tensors_of(export_run(run, out=tmp_path / "c.safetensors", dtype="fp32").path)
    assert all(FLUX_KEY.match(k) for k in sd), [k for k in sd if not FLUX_KEY.match(k)][:5]
    deltas, not_loaded = comfy_load(sd, flux_key_map(base_model("chroma")))
    assert not not_loaded, sorted(not_loaded)[:5]
    assert_deltas_equal(deltas, trained_deltas(model))
    meta = header(tmp_path / "c.safetensors")
    assert meta["ss_base_model_version"] == "chroma" and "ss_guidance_scale" not in meta


def qwen_image_key_map(transformer: nn.Module):
    """ComfyUI's names for a Qwen-Image weight ``<p>`` (its modules are diffusers' one to one):
    ``diffusion_model.<p>`` and ``lora_unet_<p, _>`` (model_lora_keys_unet's loop for every model),
    ``<p>``, ``transformer.<p>`` and ``lycoris_<p, _>`` (its QwenImage branch)."""
    out = {}
    for form in (lambda n: f"diffusion_model.{n}", lambda n: "lora_unet_" + n.replace(".", "_"), lambda n: n,
                 lambda n: f"transformer.{n}", lambda n: "lycoris_" + n.replace(".", "_")):
        out |= module_key_map(transformer, form, types=(nn.Linear,))
    return out


@pytest.mark.parametrize("family, fmt, pattern", [
    ("qwen_image", "default", r"^diffusion_model\.transformer_blocks\.\d+\.[a-z0-9_.]+\.(lora_down\.weight|lora_up\.weight|alpha)$"),
    ("qwen_image", "kohya", r"^lora_unet_transformer_blocks_\d+_[a-z0-9_]+\.(lora_down\.weight|lora_up\.weight|alpha)$"),
    # The Edit models are Qwen-Image's transformer: ComfyUI loads their LoRAs with the same map.
    ("qwen_image_edit_plus", "default", r"^diffusion_model\.transformer_blocks\.\d+\.[a-z0-9_.]+\.(lora_down\.weight|lora_up\.weight|alpha)$")])
def test_qwen_image_export_maps_in_comfyui_with_exact_deltas(family: str, fmt: str, pattern: str, tmp_path) -> None:
    run, model = make_run(tmp_path, family, rank=4, alpha=6.0)
    sd = tensors_of(export_run(run, out=tmp_path / "q.safetensors", fmt=fmt, dtype="fp32").path)
    assert sd and all(re.match(pattern, k) for k in sd), [k for k in sd if not re.match(pattern, k)][:5]
    deltas, not_loaded = comfy_load(sd, qwen_image_key_map(base_model(family)))
    assert not not_loaded, sorted(not_loaded)[:5]
    assert_deltas_equal(deltas, trained_deltas(model))
    last = len(model.transformer_blocks) - 1  # its text stream's outputs are never read: not adapted
    assert f"transformer_blocks.{last}.txt_mlp.net.2" not in deltas and f"transformer_blocks.{last}.attn.add_q_proj" not in deltas
    assert f"transformer_blocks.{last}.attn.add_k_proj" in deltas  # the text keys still reach the image
    meta = header(tmp_path / "q.safetensors")
    assert meta["ss_base_model_version"] == "qwen_image" and meta["ss_timestep_sampling"] == "shift"
    assert meta["modelspec.architecture"] == {"qwen_image": "Qwen-Image/lora",
                                              "qwen_image_edit_plus": "Qwen-Image-Edit-2509/lora"}[family]


@pytest.mark.parametrize("fmt", ["default", "kohya"])
def test_selected_blocks_with_their_own_ranks_export_exactly_what_was_trained(fmt: str, tmp_path) -> None:
    # lora.blocks / block_ranks / block_alphas: ComfyUI maps every key (FLUX's kohya form fuses q, k, v
    # per block, with each block's own rank and alpha), and only the selected blocks are in the file.
    extra = ('lora.blocks=["double:1", "single:2-3"]', 'lora.block_ranks={"single:3" = 2}',
             'lora.block_alphas={"double" = 5.0}')
    run, model = make_run(tmp_path, "flux", rank=4, alpha=3.0, extra=extra)
    trained = trained_deltas(model)
    assert {n.split(".")[0] + "." + n.split(".")[1] for n in trained} == {
        "transformer_blocks.1", "single_transformer_blocks.2", "single_transformer_blocks.3"}
    sd = tensors_of(export_run(run, out=tmp_path / "b.safetensors", fmt=fmt, dtype="fp32").path)
    if fmt == "default":
        deltas, not_loaded = comfy_load(sd, flux_key_map(base_model("flux")))
        assert not not_loaded, sorted(not_loaded)[:5]
        assert_deltas_equal(deltas, trained)
        assert sd["transformer.single_transformer_blocks.3.proj_out.lora_A.weight"].shape[0] == 2
        assert sd["transformer.transformer_blocks.1.attn.to_q.alpha"].item() == 5.0
        assert sd["transformer.single_transformer_blocks.2.proj_out.alpha"].item() == 3.0
    else:
        names = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in sd}
        assert {n.split("_")[2] + "_" + n.split("_")[3] + "_" + n.split("_")[4] for n in names} == {
            "double_blocks_1", "single_blocks_2", "single_blocks_3"}
    meta = header(tmp_path / "b.safetensors")
    args = json.loads(meta["ss_network_args"])
    assert args["blocks"] == "double:1,single:2-3" and args["block_dims"] == "single:3=2"


def test_bf16_export_is_the_trained_weights_rounded_once(flux_run, tmp_path) -> None:
    run, model = flux_run
    sd = tensors_of(export_run(run, out=tmp_path / "b.safetensors").path)  # dtype from the run: bf16
    trained = lora.adapter_state_dict(model)
    weights = {k: v for k, v in sd.items() if not k.endswith(".alpha")}
    assert len(weights) == len(trained)
    for key, value in weights.items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, trained[key.removeprefix("transformer.")].to(torch.bfloat16)), key


def _bfl_zero_checkpoint(transformer: nn.Module) -> dict[str, torch.Tensor]:
    """A FLUX checkpoint in BFL names, all zeros, built from the diffusers model's shapes."""
    rows: dict[str, dict[str, nn.Linear]] = {}
    for name, m in transformer.named_modules():
        if isinstance(m, nn.Linear):
            rows.setdefault(flux_keys.flux_bfl_module(name), {})[name] = m
    sd = {}
    for bfl, parts in rows.items():
        order = [p for p, _ in flux_keys.flux_fused_parts(bfl) or [(next(iter(parts)), 1)]]
        n_out, n_in = sum(parts[p].out_features for p in order), parts[order[0]].in_features
        sd[f"{bfl}.weight"], sd[f"{bfl}.bias"] = torch.zeros(n_out, n_in), torch.zeros(n_out)
    norms = {"transformer_blocks": {"attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
                                    "attn.norm_added_q": "txt_attn.norm.query_norm",
                                    "attn.norm_added_k": "txt_attn.norm.key_norm"},
             "single_transformer_blocks": {"attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}}
    for name, p in transformer.named_parameters():
        kind, n, rest = (name.split(".", 2) + ["", ""])[:3]
        leaf = rest.removesuffix(".weight")
        if kind in norms and leaf in norms[kind]:
            bfl_block = "double_blocks" if kind == "transformer_blocks" else "single_blocks"
            sd[f"{bfl_block}.{n}.{norms[kind][leaf]}.scale"] = torch.zeros_like(p)
    return sd


def _diffusers_flux_converter(inner_dim: int):
    """diffusers' BFL -> diffusers FLUX converter, with its hard-coded 3072 hidden size made the tiny one."""
    import diffusers.loaders.single_file_utils as sfu

    src = inspect.getsource(sfu.convert_flux_transformer_checkpoint_to_diffusers)
    assert "inner_dim = 3072" in src, "diffusers changed its FLUX converter; update this test"
    scope = dict(vars(sfu))
    exec(src.replace("inner_dim = 3072", f"inner_dim = {inner_dim}"), scope)
    return scope["convert_flux_transformer_checkpoint_to_diffusers"]


def test_flux_kohya_fused_form_rebuilds_every_trained_delta(flux_mixed_run, tmp_path) -> None:
    """ComfyUI patches the fused BFL weights with the kohya file; diffusers' own converter then
    splits them back into diffusers modules, which must carry exactly the trained deltas (zero for
    untrained slices). This checks names, slice order, the norm_out swap and the fused alpha."""
    run, model = flux_mixed_run
    res = export_run(run, out=tmp_path / "k.safetensors", dtype="fp32", fmt="kohya")
    sd = tensors_of(res.path)
    assert all(FLUX_KOHYA_KEY.match(k) for k in sd), [k for k in sd if not FLUX_KOHYA_KEY.match(k)][:5]

    base = base_model("flux")
    bfl = _bfl_zero_checkpoint(base)
    key_map = {"lora_unet_" + k.removesuffix(".weight").replace(".", "_"): (k, v.shape)
               for k, v in bfl.items() if k.endswith(".weight") and v.dim() == 2}  # ComfyUI's diffusion_model.* rule
    deltas, not_loaded = comfy_load(sd, key_map)
    assert not not_loaded, sorted(not_loaded)[:5]
    for key, delta in deltas.items():
        bfl[key] += delta
    inner = base.config.num_attention_heads * base.config.attention_head_dim
    converted = _diffusers_flux_converter(inner)(bfl)
    assert not bfl, f"BFL keys diffusers did not consume: {sorted(bfl)[:5]}"
    assert set(converted) == set(base.state_dict())
    want = trained_deltas(model)
    assert "norm_out.linear" in want and "x_embedder" in want
    for name, value in converted.items():
        expected = want.get(name.removesuffix(".weight"), torch.zeros_like(value)) if name.endswith(".weight") \
            else torch.zeros_like(value)
        torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-7, msg=name)


def test_fused_alpha_is_k_times_alpha_and_slices_are_exact(flux_mixed_run, tmp_path) -> None:
    run, model = flux_mixed_run
    sd = tensors_of(export_run(run, out=tmp_path / "k.safetensors", dtype="fp32", fmt="kohya").path)
    peft = {n: m for n, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    # Double block 0: q and v trained, k not -> fused rank 2·3, alpha 2·5 (kohya's split_qkv would keep 5).
    k = "lora_unet_double_blocks_0_img_attn_qkv"
    down, up, alpha = sd[f"{k}.lora_down.weight"], sd[f"{k}.lora_up.weight"], sd[f"{k}.alpha"].item()
    q, v = peft["transformer_blocks.0.attn.to_q"], peft["transformer_blocks.0.attn.to_v"]
    h = q.base_layer.out_features
    assert down.shape == (6, h) and up.shape == (3 * h, 6) and alpha == 10.0
    assert alpha / down.shape[0] == 5.0 / 3
    assert torch.equal(down, torch.cat([q.lora_A["default"].weight, v.lora_A["default"].weight]))
    assert torch.equal(up[:h, :3], q.lora_B["default"].weight)
    assert torch.equal(up[2 * h:, 3:], v.lora_B["default"].weight)
    assert not up[:h, 3:].any() and not up[h:2 * h].any() and not up[2 * h:, :3].any()
    # Single block 1: q, k, v and the MLP input, fused rank 4·3, alpha 4·5.
    k1 = "lora_unet_single_blocks_1_linear1"
    assert sd[f"{k1}.lora_down.weight"].shape == (12, h) and sd[f"{k1}.alpha"].item() == 20.0
    assert sd[f"{k1}.lora_up.weight"].shape == (7 * h, 12)


def test_fuse_folds_differing_scales_into_up() -> None:
    gen = torch.Generator().manual_seed(0)
    a = ex.LoraModule(torch.randn(2, 8, generator=gen), torch.randn(8, 2, generator=gen), alpha=2.0)
    b = ex.LoraModule(torch.randn(4, 8, generator=gen), torch.randn(8, 4, generator=gen), alpha=1.0)
    fused = ex.fuse([a, None, b], [8, 8, 8])
    full = fused.alpha / fused.rank * fused.up @ fused.down
    torch.testing.assert_close(full[:8], a.alpha / a.rank * a.up @ a.down)
    assert not full[8:16].any()
    torch.testing.assert_close(full[16:], b.alpha / b.rank * b.up @ b.down)


# ---------------------------------------------------------------------------------------------
# diffusers loads the default export and reproduces the peft model
# ---------------------------------------------------------------------------------------------


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def load_in_pipeline(family: str, path: Path):
    import diffusers

    pipe = getattr(diffusers, get_family(family).pipeline).from_pretrained(resolve_model(f"tiny:{family}", get_family(family)).root)
    capture = _Capture()
    logger = logging.getLogger("diffusers")
    logger.addHandler(capture)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe.load_lora_weights(str(path))
    finally:
        logger.removeHandler(capture)
    # The text encoders get no LoRA keys, as intended; anything else about keys is a failure.
    problems = [m for m in capture.messages + [str(w.message) for w in caught]
                if re.search(r"unexpected|missing|not match|not loaded|ignored", m, re.I)
                and not m.startswith("No LoRA keys associated to CLIPText")]
    assert not problems, problems
    return pipe


def assert_same_adapters(loaded: nn.Module, trained: nn.Module) -> None:
    """Same adapted modules, same weights, same scaling: nothing missing, nothing extra."""
    want = {n: m for n, m in trained.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    got = {n: m for n, m in loaded.named_modules() if hasattr(m, "lora_A") and len(m.lora_A)}
    assert set(got) == set(want)
    for name, m in got.items():
        (adapter,) = m.lora_A.keys()
        assert m.scaling[adapter] == want[name].scaling["default"], name
        assert torch.equal(m.lora_A[adapter].weight, want[name].lora_A["default"].weight), name
        assert torch.equal(m.lora_B[adapter].weight, want[name].lora_B["default"].weight), name


def test_sdxl_export_loads_in_diffusers_with_same_output(sdxl_run, tmp_path) -> None:
    run, model = sdxl_run
    pipe = load_in_pipeline("sdxl", export_run(run, out=tmp_path / "s.safetensors", dtype="fp32").path)
    assert_same_adapters(pipe.unet, model)
    gen = torch.Generator().manual_seed(1)
    cond = model.config.cross_attention_dim
    pooled = model.config.projection_class_embeddings_input_dim - 6 * model.config.addition_time_embed_dim
    inputs = dict(sample=torch.randn(1, 4, 16, 16, generator=gen), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 7, cond, generator=gen),
                  added_cond_kwargs={"text_embeds": torch.randn(1, pooled, generator=gen),
                                     "time_ids": torch.tensor([[128.0, 128, 0, 0, 128, 128]])})
    with torch.no_grad():
        want = model(**inputs).sample
        got = pipe.unet(**inputs).sample
        model.disable_adapters()
        plain = model(**inputs).sample
        model.enable_adapters()
    assert (want - plain).abs().max() > 1e-3  # the adapter changes the output
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flux_export_loads_in_diffusers_with_same_output(flux_run, tmp_path) -> None:
    run, model = flux_run
    pipe = load_in_pipeline("flux", export_run(run, out=tmp_path / "f.safetensors", dtype="fp32").path)
    assert_same_adapters(pipe.transformer, model)
    inputs = flux_inputs(model)
    with torch.no_grad():
        want = model(**inputs).sample
        got = pipe.transformer(**inputs).sample
        model.disable_adapters()
        plain = model(**inputs).sample
        model.enable_adapters()
    assert (want - plain).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def flux_inputs(model: nn.Module) -> dict:
    gen = torch.Generator().manual_seed(1)
    c = model.config
    img, txt = 16, 8
    return dict(hidden_states=torch.randn(1, img, c.in_channels, generator=gen),
                encoder_hidden_states=torch.randn(1, txt, c.joint_attention_dim, generator=gen),
                pooled_projections=torch.randn(1, c.pooled_projection_dim, generator=gen),
                timestep=torch.tensor([0.5]), guidance=torch.tensor([1.0]),
                img_ids=torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0),
                                                   indexing="ij"), -1).reshape(img, 3),
                txt_ids=torch.zeros(txt, 3))


def test_flux_kohya_export_loads_in_diffusers_double_blocks(tmp_path) -> None:
    """diffusers' kohya converter is an independent reading of the fused form and its alpha
    (scale = alpha / fused rank). It hard-codes FLUX.1's 3072-wide single blocks, so this tiny
    model adapts only its double blocks."""
    targets = [n for n, m in base_model("flux").named_modules()
               if isinstance(m, nn.Linear) and n.startswith("transformer_blocks.")]
    run, model = make_run(tmp_path, "flux", rank=2, alpha=7.0, peft_targets=targets)
    path = export_run(run, out=tmp_path / "k.safetensors", dtype="fp32", fmt="kohya").path
    assert any(k.endswith("img_attn_qkv.alpha") for k in tensors_of(path))
    pipe = load_in_pipeline("flux", path)
    inputs = flux_inputs(model)
    with torch.no_grad():
        torch.testing.assert_close(pipe.transformer(**inputs).sample, model(**inputs).sample, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------


def test_metadata_kohya_modelspec_and_base_model(sdxl_run, tmp_path) -> None:
    run, _ = sdxl_run
    res = export_run(run, out=tmp_path / "m.safetensors")
    meta = header(res.path)
    assert meta == res.metadata
    assert meta["ss_network_module"] == "networks.lora" and meta["ss_base_model_version"] == "sdxl_base_v1-0"
    assert (meta["ss_network_dim"], meta["ss_network_alpha"]) == ("4", "8.0")
    assert meta["ss_resolution"] == "(128, 128)" and meta["modelspec.resolution"] == "128x128"
    assert meta["ss_steps"] == "20" and meta["ss_output_name"] == "toy" == meta["modelspec.title"]
    assert json.loads(meta["ss_tag_frequency"]) == {"sks_toy": {TRIGGER: 5}}
    assert meta["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert meta["modelspec.trigger_phrase"] == TRIGGER and meta["modelspec.prediction_type"] == "epsilon"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", meta["modelspec.date"])
    assert meta["imglora.base_model"] == "tiny:sdxl" == meta["ss_sd_model_name"]
    assert json.loads(meta["imglora.base_model_checksums"]) == {"unet/diffusion_pytorch_model.safetensors": "a" * 64}
    assert meta["imglora.dataset_version"] == "d" * 64
    assert all(isinstance(v, str) for v in meta.values()) and "lora_adapter_metadata" not in meta
    # A1111 takes sshs_model_hash as the LoRA's hash: sha256 of the file's bytes after the header.
    blob = res.path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    assert meta["sshs_model_hash"] == hashlib.sha256(blob[8 + n:]).hexdigest()


def test_flux_metadata(flux_run, tmp_path) -> None:
    meta = export_run(flux_run[0], out=tmp_path / "m.safetensors", fmt="kohya").metadata
    assert meta["ss_network_module"] == "networks.lora_flux" and meta["ss_base_model_version"] == "flux1"
    assert meta["modelspec.architecture"] == "flux-1-dev/lora" and "modelspec.prediction_type" not in meta
    assert meta["imglora.format"] == "kohya" and meta["ss_network_alpha"] == "2.0"


# ---------------------------------------------------------------------------------------------
# Sources, destinations, errors
# ---------------------------------------------------------------------------------------------


def test_source_selection(flux_run, tmp_path) -> None:
    run, _ = flux_run
    assert ex.find_source(run).path == run / "adapter" / ADAPTER_FILE
    assert ex.find_source(run, "final").step == 20
    src = ex.find_source(run, "10")
    assert src.step == 10 and src.path == run / "checkpoints" / "step-000010" / "adapter" / ADAPTER_FILE
    with pytest.raises(ImgloraError, match=r"no checkpoint for step 7; available steps: 10"):
        ex.find_source(run, "7")
    with pytest.raises(ImgloraError, match="no such run folder"):
        ex.find_source(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ImgloraError, match="holds no adapter"):
        ex.find_source(empty)


def test_latest_prefers_a_checkpoint_newer_than_the_final_adapter(flux_run, tmp_path) -> None:
    """A finished run resumed with more steps and stopped early: its newest checkpoint is newer."""
    import shutil

    run = tmp_path / "resumed"
    shutil.copytree(flux_run[0], run)
    newer = run / "checkpoints" / "step-000030"
    shutil.copytree(run / "checkpoints" / "step-000010", newer)
    state = json.loads((newer / "state.json").read_text())
    (newer / "state.json").write_text(json.dumps({**state, "step": 30}))
    assert ex.find_source(run).step == 30
    assert ex.find_source(run, "final").step == 20


def test_exporting_an_unfinished_run_warns_with_its_update(flux_run, tmp_path) -> None:
    """An interrupted run (no final adapter): its newest checkpoint is exported, with a warning."""
    import shutil

    from click.testing import CliRunner

    from imglora.cli import main

    run = tmp_path / "stopped"
    shutil.copytree(flux_run[0], run)
    shutil.rmtree(run / "adapter")
    ckpt = run / "checkpoints" / "step-000010"
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, "total_updates": 40}))
    for rec in (run / "records").glob("*-train.json"):  # as an interrupted run records itself
        data = json.loads(rec.read_text())
        rec.write_text(json.dumps({**data, "adapter": None, "steps_done": 10, "total_updates": 40,
                                   "status": "interrupted"}))
    warning = ("the run stopped at update 10 of 40; exporting its checkpoint 10, not a finished adapter. To finish "
               "the run, resume it")
    res = CliRunner().invoke(main, ["export", str(run), "--out", str(tmp_path / "x.safetensors")])
    assert res.exit_code == 0, res.output
    assert f"warning: {warning}" in res.output and "exported" in res.output
    assert record.read_records(run, "export")[-1]["warnings"][0].startswith(warning)
    assert export_run(run, checkpoint="10", out=tmp_path / "y.safetensors").warnings == ()  # chosen: no warning
    (ckpt / "state.json").write_text(json.dumps({**state, "total_updates": 10}))  # stopped at its end
    assert export_run(run, out=tmp_path / "z.safetensors").warnings == ()


def test_text_encoder_names() -> None:
    assert sdxl_keys.module_name("text_encoder.text_model.encoder.layers.0.self_attn.q_proj") == \
        "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"
    assert sdxl_keys.module_name("text_encoder_2.text_model.encoder.layers.31.mlp.fc1") == \
        "lora_te2_text_model_encoder_layers_31_mlp_fc1"
    m = ex.LoraModule(torch.zeros(1, 2), torch.zeros(2, 1), 1.0)
    assert set(flux_keys.kohya_form({"text_encoder_2.encoder.block.0.layer.0.SelfAttention.q": m})) >= \
        {"lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_down.weight"}


def test_default_destination_and_bad_options(flux_run, tmp_path) -> None:
    run, _ = flux_run
    res = export_run(run, name="mine", force=True)
    assert res.path == run / "export" / "mine.safetensors"
    assert res.workflow_ui == run / "export" / "mine.workflow.json"
    for kwargs, pattern in [({"dtype": "int8"}, "--dtype int8"), ({"fmt": "peft"}, "--format peft"),
                            ({"name": "../x"}, "plain file name"), ({"out": tmp_path / "x.bin"}, ".safetensors"),
                            ({"out": tmp_path / "a.safetensors", "comfyui": tmp_path}, "not both")]:
        with pytest.raises(ImgloraError, match=re.escape(pattern)):
            export_run(run, **kwargs)




def test_export_into_comfyui_with_workflows(sdxl_run, tmp_path) -> None:
    run, _ = sdxl_run
    comfy = fake_comfyui(tmp_path / "ComfyUI")
    res = export_run(run, comfyui=comfy, name="toy_lora")
    assert res.path == comfy / "models" / "loras" / "toy_lora.safetensors"
    assert not list(res.path.parent.glob(".*tmp"))  # the temporary file was renamed, not left behind
    with pytest.raises(ImgloraError, match="already exists; pass --force"):
        export_run(run, comfyui=comfy, name="toy_lora")
    before = tensors_of(res.path)
    export_run(run, comfyui=comfy, name="toy_lora", force=True, fmt="kohya")
    after = tensors_of(res.path)  # SDXL's kohya form is its default form
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

    for folder in (res.path.parent, run / "export"):
        api = json.loads((folder / "toy_lora.workflow-api.json").read_text())
        ui = json.loads((folder / "toy_lora.workflow.json").read_text())
        check_workflows(api, ui, "toy_lora.safetensors", "LoraLoader")
    assert api["1"]["inputs"]["ckpt_name"] == "sd_xl_base_1.0.safetensors"
    sampler = next(n["inputs"] for n in api.values() if n["class_type"] == "KSampler")
    assert (sampler["steps"], sampler["cfg"], sampler["sampler_name"]) == (30, 7.0, "euler")


def test_exported_files_follow_the_umask_so_another_user_can_read_them(sdxl_run, tmp_path) -> None:
    import os
    import stat

    run, _ = sdxl_run
    (tmp_path / "shared").mkdir()
    old = os.umask(0o022)
    try:
        res = export_run(run, out=tmp_path / "shared", name="for_comfy")
    finally:
        os.umask(old)
    for path in (res.path, res.workflow_api, res.workflow_ui):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path  # mkstemp alone would give 0600


def test_flux_workflow_uses_split_files_and_model_only_loader(flux_run, tmp_path) -> None:
    res = export_run(flux_run[0], comfyui=fake_comfyui(tmp_path / "C"))
    api = json.loads(res.workflow_api.read_text())
    check_workflows(api, json.loads(res.workflow_ui.read_text()), "toy.safetensors", "LoraLoaderModelOnly")
    by_type = {n["class_type"]: n["inputs"] for n in api.values()}
    assert by_type["UNETLoader"]["unet_name"] == "flux1-dev.safetensors"
    assert (by_type["DualCLIPLoader"]["clip_name1"], by_type["DualCLIPLoader"]["clip_name2"]) == \
        ("clip_l.safetensors", "t5xxl_fp16.safetensors")
    assert by_type["VAELoader"]["vae_name"] == "ae.safetensors"
    assert by_type["FluxGuidance"]["guidance"] == 3.5
    assert (by_type["KSampler"]["steps"], by_type["KSampler"]["cfg"]) == (20, 1.0)


def check_workflows(api: dict, ui: dict, lora_name: str, loader: str) -> None:
    """Both formats describe one graph: same nodes, same links, the LoRA file and the trigger word."""
    (lora_node,) = [n for n in api.values() if n["class_type"] == loader]
    assert lora_node["inputs"]["lora_name"] == lora_name and lora_node["inputs"]["strength_model"] == 1.0
    texts = [n["inputs"]["text"] for n in api.values() if n["class_type"] == "CLIPTextEncode"]
    assert any(TRIGGER in t and "wooden table" in t for t in texts)
    assert any(n["class_type"] == "SaveImage" for n in api.values())
    for node in api.values():  # every link points at an existing node's output
        for value in node["inputs"].values():
            if isinstance(value, list):
                assert value[0] in api and isinstance(value[1], int)

    assert ui["version"] == 0.4 and ui["last_link_id"] == len(ui["links"])
    nodes = {n["id"]: n for n in ui["nodes"]}
    assert {str(i) for i in nodes} == set(api) and ui["last_node_id"] == max(nodes)
    ui_links = set()
    for link_id, src, src_slot, dst, dst_slot, type_ in ui["links"]:
        assert nodes[dst]["inputs"][dst_slot]["link"] == link_id and nodes[dst]["inputs"][dst_slot]["type"] == type_
        assert link_id in nodes[src]["outputs"][src_slot]["links"]
        ui_links.add((str(src), src_slot, str(dst), nodes[dst]["inputs"][dst_slot]["name"]))
    api_links = {(v[0], v[1], nid, name) for nid, n in api.items() for name, v in n["inputs"].items()
                 if isinstance(v, list)}
    assert ui_links == api_links
    assert lora_name in nodes[int(next(k for k, n in api.items() if n["class_type"] == loader))]["widgets_values"]


def test_comfyui_folder_detection(tmp_path) -> None:
    from imglora.models import comfyui

    with pytest.raises(ImgloraError, match="is not a ComfyUI folder"):
        comfyui.find_root(tmp_path)
    root = fake_comfyui(tmp_path / "ComfyUI_windows_portable" / "ComfyUI")
    assert comfyui.find_root(root.parent) == root.resolve()  # the portable build's outer folder
    with pytest.raises(ImgloraError, match="pass that folder instead"):
        comfyui.find_root(root / "models" / "loras")
    with pytest.raises(ImgloraError, match="no such folder"):
        comfyui.find_root(tmp_path / "missing")


def test_extra_model_paths_yaml_default_lora_folder(flux_run, tmp_path) -> None:
    from imglora.models import comfyui

    root = fake_comfyui(tmp_path / "ComfyUI")
    shared = tmp_path / "shared"
    (shared / "Lora").mkdir(parents=True)
    (root / "extra_model_paths.yaml").write_text(
        "a111:\n  base_path: ../shared\n  loras: |\n    Lora\n    LyCORIS\n"
        f"mine:\n  base_path: {tmp_path}\n  is_default: true\n  loras: shared/Lora\n")
    # ComfyUI's order: the is_default folder first, then models/loras, then the other extra folders.
    assert comfyui.model_folders(root.resolve(), "loras") == [shared / "Lora", root.resolve() / "models" / "loras",
                                                    shared / "LyCORIS"]
    res = export_run(flux_run[0], comfyui=root, name="shared_lora")
    assert res.path == shared / "Lora" / "shared_lora.safetensors"
    (root / "extra_model_paths.yaml").write_text("x:\n  is_default: true\n  loras: /nonexistent/loras\n")
    with pytest.raises(ImgloraError, match="does not exist"):
        export_run(flux_run[0], comfyui=root, name="other")

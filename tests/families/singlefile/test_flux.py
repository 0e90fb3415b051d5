"""load_flux_transformer / flux_plan on BFL files written from the tiny FLUX model."""

from __future__ import annotations


import copy

import pytest
import torch
from checks import assert_same_output, assert_same_weights, owned
from safetensors.torch import load_file, save_file

from imglora.errors import ModelSourceError
from imglora.families.flux.singlefile import flux_plan, load_flux_transformer
from imglora.plan.meter import LiveBytes

FP8 = torch.float8_e4m3fn
BLOCKS = ("transformer_blocks.", "single_transformer_blocks.")


@pytest.fixture(scope="module")
def config(flux_dir):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.load_config(flux_dir, subfolder="transformer")


@pytest.fixture(scope="module")
def ref(flux_dir):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(flux_dir, subfolder="transformer")


def _is_fp8_in_file(key: str, tensor: torch.Tensor) -> bool:
    """The weights write_bfl_flux stores as fp8: 2-D Linear weights inside the blocks."""
    return key.startswith(BLOCKS) and key.endswith(".weight") and tensor.ndim == 2


@pytest.mark.parametrize("name", ["bfl", "bfl_prefixed"])
def test_equals_the_diffusers_folder(files, config, ref, name):
    assert_same_weights(load_flux_transformer(files[name], config, dtype=torch.float32), ref)


def test_forward_is_identical(files, config, ref):
    model = load_flux_transformer(files["bfl"], config, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    tokens, text = 16, 5
    inputs = {"hidden_states": torch.randn(1, tokens, config["in_channels"], generator=g),
              "encoder_hidden_states": torch.randn(1, text, config["joint_attention_dim"], generator=g),
              "pooled_projections": torch.randn(1, config["pooled_projection_dim"], generator=g),
              "timestep": torch.tensor([0.5]), "guidance": torch.tensor([3.5]),
              "img_ids": torch.zeros(tokens, 3), "txt_ids": torch.zeros(text, 3)}
    inputs["img_ids"][:, 1] = torch.arange(tokens)
    mine = owned(copy.deepcopy(ref))
    with torch.no_grad():
        assert_same_output(model(**inputs).sample, ref(**inputs).sample, mine(**inputs).sample)


def test_fp8_file_equals_the_fp8_rounded_weights(files, config, ref):
    want = {k: v.to(FP8).to(torch.bfloat16) if _is_fp8_in_file(k, v) else v.to(torch.bfloat16)
            for k, v in ref.state_dict().items()}
    got = load_flux_transformer(files["bfl_fp8"], config, dtype=torch.bfloat16)
    assert_same_weights(got, want)
    assert any(not torch.equal(want[k], v.to(torch.bfloat16)) for k, v in ref.state_dict().items())


def test_scaled_fp8_is_multiplied_by_its_scale(files, config, ref):
    want = {}
    for k, v in ref.state_dict().items():
        if _is_fp8_in_file(k, v):
            # the scale belongs to the fused BFL tensor (qkv / linear1), not to the q, k, v parts
            v = None
        want[k] = v
    raw = load_file(files["bfl_scaled"])
    from imglora.families.flux.singlefile import flux_plan as plan_of

    plan = plan_of(config)
    for k, v in want.items():
        if v is None:
            src, rows, _ = plan[k]
            stem = src[: -len("weight")]
            w = raw[src].float() * raw[stem + "scale_weight"]
            want[k] = w if rows is None else w[rows[0]:rows[1]]
    got = load_flux_transformer(files["bfl_scaled"], config, dtype=torch.float32)
    assert_same_weights(got, want)
    # and the scale matters: without it the weights would be off by orders of magnitude
    w = got.state_dict()["single_transformer_blocks.0.proj_out.weight"]
    assert torch.allclose(w, ref.state_dict()["single_transformer_blocks.0.proj_out.weight"], rtol=0.13, atol=1e-3)


def test_plan_covers_the_real_flux1_dev_model_on_meta():
    """flux_plan is pure: for FLUX.1-dev's published config it names every one of the 1160
    diffusers keys, from the 780 tensors of flux1-dev.safetensors."""
    from diffusers import FluxTransformer2DModel

    dev = {"attention_head_dim": 128, "axes_dims_rope": [16, 56, 56], "guidance_embeds": True, "in_channels": 64,
           "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 19, "num_single_layers": 38,
           "patch_size": 1, "pooled_projection_dim": 768}
    plan = flux_plan(dev)
    with torch.device("meta"):
        keys = set(FluxTransformer2DModel(**dev).state_dict())
    assert set(plan) == keys and len(keys) == 1160
    assert len({src for src, _, _ in plan.values()}) == 780
    assert plan["single_transformer_blocks.3.proj_mlp.weight"] == ("single_blocks.3.linear1.weight", (9216, 21504), "copy")
    assert plan["transformer_blocks.0.attn.add_k_proj.bias"] == ("double_blocks.0.txt_attn.qkv.bias", (3072, 6144), "copy")
    assert plan["norm_out.linear.weight"] == ("final_layer.adaLN_modulation.1.weight", None, "swap")
    assert plan["transformer_blocks.7.attn.norm_added_q.weight"] == ("double_blocks.7.txt_attn.norm.query_norm.scale", None, "copy")
    schnell = flux_plan({**dev, "guidance_embeds": False})
    assert len({src for src, _, _ in schnell.values()}) == 776


def test_on_block_sees_each_block_once_in_order_complete(files, config):
    seen = []

    def on_block(kind, index, block):
        assert all(not p.is_meta for p in block.parameters())
        seen.append((kind, index))

    load_flux_transformer(files["bfl"], config, dtype=torch.float32, on_block=on_block)
    assert seen == [("double", i) for i in range(config["num_layers"])] + \
                   [("single", i) for i in range(config["num_single_layers"])]


def _peak_bytes(run):
    with LiveBytes(count_meta=False) as meter:
        result = run()
    return meter.peak, result


def _nbytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if not p.is_meta)


@pytest.mark.parametrize("name", ["bfl", "bfl_fp8", "bfl_scaled"])
def test_streaming_peak_stays_below_non_block_weights_plus_two_blocks(files, config, name):
    seen: list[torch.nn.Module] = []
    block_bytes: list[int] = []
    at_once: list[int] = []

    def offload(kind, index, block):
        """Stand-in for moving the block to the GPU or quantizing it: it leaves host memory."""
        seen.append(block)
        block_bytes.append(_nbytes(block))
        at_once.append(sum(_nbytes(b) for b in seen))  # blocks materialized right now
        block.to("meta")

    peak, model = _peak_bytes(
        lambda: load_flux_transformer(files[name], config, dtype=torch.float32, on_block=offload))
    non_block = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith(BLOCKS))
    assert non_block > 0 and len(block_bytes) == config["num_layers"] + config["num_single_layers"]
    assert at_once == block_bytes  # one block at a time
    assert peak <= non_block + 2 * max(block_bytes), (peak, non_block, max(block_bytes))
    assert peak < (non_block + sum(block_bytes)) / 2  # nothing like a full copy of the model


def test_keeping_every_block_costs_the_model_plus_one_block(files, config):
    peak, model = _peak_bytes(lambda: load_flux_transformer(files["bfl"], config, dtype=torch.float32))
    total = _nbytes(model)
    largest = max(_nbytes(b) for b in [*model.transformer_blocks, *model.single_transformer_blocks])
    assert total <= peak <= total + largest


def test_wrong_files_and_configs_are_refused_before_reading(files, config, tmp_path):
    sd = {k: v for k, v in load_file(files["bfl"]).items() if not k.startswith("guidance_in.")}
    save_file(sd, tmp_path / "flux1-schnell.safetensors")
    with pytest.raises(ModelSourceError, match="FLUX.1-schnell.*guidance_embeds=true"):
        load_flux_transformer(tmp_path / "flux1-schnell.safetensors", config, dtype=torch.float32)
    with pytest.raises(ModelSourceError, match="FLUX.1-dev.*guidance_embeds=false"):
        load_flux_transformer(files["bfl"], {**config, "guidance_embeds": False}, dtype=torch.float32)
    fewer = {**config, "num_single_layers": config["num_single_layers"] - 1}
    with pytest.raises(ModelSourceError, match=r"not in the model: single_blocks\.7\."):
        load_flux_transformer(files["bfl"], fewer, dtype=torch.float32)
    more = {**config, "num_layers": config["num_layers"] + 1}
    with pytest.raises(ModelSourceError, match=r"missing: double_blocks\.4\."):
        load_flux_transformer(files["bfl"], more, dtype=torch.float32)
    wider = {**config, "attention_head_dim": config["attention_head_dim"] * 2, "axes_dims_rope": [8, 12, 12]}
    with pytest.raises(ModelSourceError, match="with another shape"):
        load_flux_transformer(files["bfl"], wider, dtype=torch.float32)

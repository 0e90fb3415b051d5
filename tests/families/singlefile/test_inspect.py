"""describe(): what a file is, from its header; pickles, broken files and LoRAs refused by name."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from imglora.errors import ModelSourceError
from imglora.families.flux.singlefile import load_flux_transformer
from imglora.families.sdxl.singlefile import load_sdxl
from imglora.families._shared.singlefile.inspect import describe
from imglora.families._shared.singlefile.text import load_clip_l
from imglora.families._shared.singlefile.inspect import expect


@pytest.mark.parametrize("name, kind, prefix, parts, variant, fp8", [
    ("sgm", "sdxl-checkpoint", "model.diffusion_model.", ("unet", "clip_l", "clip_g", "vae"), None, False),
    ("sgm_novae", "sdxl-checkpoint", "model.diffusion_model.", ("unet", "clip_l", "clip_g"), None, False),
    ("sdxl_vae", "vae-sdxl", "", (), None, False),
    ("bfl", "flux-transformer", "", ("transformer",), "dev", False),
    ("bfl_prefixed", "flux-transformer", "model.diffusion_model.", ("transformer",), "dev", False),
    ("bfl_fp8", "flux-transformer", "", ("transformer",), "dev", True),
    ("bfl_scaled", "flux-transformer", "", ("transformer",), "dev", True),
    ("clip_l", "clip-l", "", (), None, False),
    ("t5", "t5xxl", "", (), None, False),
    ("t5_fp8", "t5xxl", "", (), None, True),
    ("ae", "vae-flux", "", (), None, False),
])
def test_describe_classifies_each_layout(files, name, kind, prefix, parts, variant, fp8):
    layout = describe(files[name])
    assert (layout.kind, layout.prefix, layout.parts, layout.variant, layout.fp8) == (kind, prefix, parts, variant, fp8)
    assert layout.scaled == (name == "bfl_scaled")
    assert layout.path == files[name] and layout.tensors > 0
    assert kind in str(layout)


def test_schnell_is_told_from_dev_by_guidance_in(files, tmp_path):
    sd = {k: v for k, v in load_file(files["bfl"]).items() if not k.startswith("guidance_in.")}
    save_file(sd, tmp_path / "flux1-schnell.safetensors")
    assert describe(tmp_path / "flux1-schnell.safetensors").variant == "schnell"


def test_lora_is_classified_and_refused_as_a_base(tmp_path, sdxl_dir, flux_dir):
    lora = tmp_path / "my_lora.safetensors"
    save_file({"lora_unet_down_blocks_1_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 32),
               "lora_unet_down_blocks_1_attentions_0_proj_in.lora_up.weight": torch.zeros(32, 4),
               "lora_unet_down_blocks_1_attentions_0_proj_in.alpha": torch.tensor(4.0)}, lora)
    assert describe(lora).kind == "lora"
    peft = tmp_path / "peft_lora.safetensors"
    save_file({"transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 32)}, peft)
    assert describe(peft).kind == "lora"
    from diffusers import FluxTransformer2DModel

    for call in (lambda: load_sdxl(lora, sdxl_dir, dtype=torch.float32),
                 lambda: load_flux_transformer(peft, FluxTransformer2DModel.load_config(flux_dir, subfolder="transformer"),
                                               dtype=torch.float32),
                 lambda: load_clip_l(lora, flux_dir, torch.float32)):
        with pytest.raises(ModelSourceError, match="is a LoRA") as exc:
            call()
        assert "base model" in str(exc.value) and "_lora.safetensors" in str(exc.value)


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".pth", ".bin"])
def test_pickles_are_refused_with_a_conversion_command(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    torch.save({"state_dict": {"a": torch.zeros(2)}}, path)
    with pytest.raises(ModelSourceError) as exc:
        describe(path)
    message = str(exc.value)
    assert str(path) in message and ".safetensors files only" in message
    assert "torch.load(" in message and "weights_only=True" in message and "st.save_file(" in message


def test_a_pickle_named_safetensors_is_refused_by_its_content(tmp_path):
    path = tmp_path / "renamed.safetensors"
    torch.save({"a": torch.zeros(2)}, path)
    with pytest.raises(ModelSourceError, match="is a pickle file"):
        describe(path)


def _run_conversion(message: str) -> None:
    """Run the command the refusal prints (on a file this test wrote, so it may be unpickled)."""
    import shlex
    import subprocess
    import sys

    argv = shlex.split(message.splitlines()[-1].strip())
    assert argv[:2] == ["python", "-c"]
    subprocess.run([sys.executable, *argv[1:]], check=True, capture_output=True, timeout=120)


@pytest.mark.parametrize("name, converted", [pytest.param("renamed.safetensors", "renamed.converted.safetensors",
                                                          marks=pytest.mark.slow),
                                             ("model.ckpt", "model.safetensors")])
def test_the_conversion_command_writes_a_new_file_and_keeps_the_input(tmp_path, name, converted):
    path = tmp_path / name
    torch.save({"state_dict": {"a": torch.arange(3.0)}}, path)
    before = path.read_bytes()
    with pytest.raises(ModelSourceError) as exc:
        describe(path)
    out = tmp_path / converted
    assert f"'{out}'" in str(exc.value) and f"'{path}'" in str(exc.value)
    _run_conversion(str(exc.value))
    assert path.read_bytes() == before  # the input is never written over
    assert torch.equal(load_file(out)["a"], torch.arange(3.0))


def test_the_conversion_command_never_writes_over_a_file_already_there(tmp_path):
    path = tmp_path / "model.ckpt"
    torch.save({"a": torch.zeros(2)}, path)
    (tmp_path / "model.safetensors").write_bytes(b"someone else's file")
    with pytest.raises(ModelSourceError) as exc:
        describe(path)
    assert f"'{tmp_path / 'model.converted.safetensors'}'" in str(exc.value)


def test_truncated_and_foreign_files_name_the_file(files, tmp_path):
    data = files["ae"].read_bytes()
    truncated = tmp_path / "ae_partial.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelSourceError, match="not a readable safetensors file") as exc:
        describe(truncated)
    assert str(truncated) in str(exc.value) and "download it again" in str(exc.value)
    html = tmp_path / "login_page.safetensors"
    html.write_text("<!doctype html><html>please log in</html>")
    with pytest.raises(ModelSourceError, match="login_page.safetensors"):
        describe(html)
    with pytest.raises(ModelSourceError, match="does not exist"):
        describe(tmp_path / "nope.safetensors")


def test_unknown_and_wrong_kind_files_say_what_they_are(files, tmp_path, flux_dir):
    odd = tmp_path / "odd.safetensors"
    save_file({"foo.weight": torch.zeros(1), "bar.bias": torch.zeros(1)}, odd)
    layout = describe(odd)
    assert layout.kind == "unknown" and layout.first_keys == ("bar.bias", "foo.weight")
    assert "bar.bias" in str(layout)
    diffusers_file = next((flux_dir / "transformer").glob("*.safetensors"))
    assert "diffusers' own layout" in describe(diffusers_file).note
    with pytest.raises(ModelSourceError, match="not a FLUX.1 transformer.*vae-flux"):
        expect(files["ae"], "flux-transformer")
    shutil.copy(files["ae"], tmp_path / "ae.safetensors")
    with pytest.raises(ModelSourceError, match="not an SDXL checkpoint"):
        load_sdxl(tmp_path / "ae.safetensors", flux_dir, dtype=torch.float32)


def test_sd15_like_and_refiner_checkpoints_are_named(files, tmp_path):
    sd = load_file(files["sgm"])
    sd15 = {k: v for k, v in sd.items() if ".label_emb." not in k}
    save_file(sd15, tmp_path / "sd15.safetensors")
    assert "SD1.x/SD2.x" in describe(tmp_path / "sd15.safetensors").note
    refiner = {k.replace("conditioner.embedders.1.", "conditioner.embedders.0."): v for k, v in sd.items()
               if not k.startswith("conditioner.embedders.0.")}
    save_file(refiner, tmp_path / "refiner.safetensors")
    layout = describe(tmp_path / "refiner.safetensors")
    assert layout.parts == ("unet", "vae") and "refiner" in layout.note

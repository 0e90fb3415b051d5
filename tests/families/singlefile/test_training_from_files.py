"""Training from the single files users have gives exactly what training from the diffusers folder
gives, with the files found by path or by bare name in a ComfyUI folder; a wrong file is one named
error before anything loads; the record and the export name the files trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from layouts import (make_comfyui_tree, write_bfl_chroma, write_bfl_flux, write_clip_l, write_flux_ae, write_sgm_sdxl,
                     write_t5xxl)
from safetensors.torch import load_file

from imglora.runs import record
from imglora.commands.common import load_config
from imglora.commands.train import train
from imglora.errors import ModelSourceError
from imglora.families import registry
from imglora.models.resolve import resolve_model
from imglora.models.tiny import ensure_tiny
from imglora.memory.wrap import resolve_swap

REPO = Path(__file__).resolve().parents[3]


def preset(name: str, tmp_path: Path, sample_dataset: Path, *extra: str):
    return load_config(REPO / "presets" / f"tiny-{name.replace('_', '-')}.toml", [
        f"data.dir={json.dumps(str(sample_dataset))}", f"cache.dir={json.dumps(str(tmp_path / 'cache'))}",
        f"run.output_dir={json.dumps(str(tmp_path / 'runs'))}", "train.max_steps=4", "train.warmup_steps=0",
        "train.log_every=1", "train.checkpoint_every=0", *extra])


def trained(cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    result = train(cfg, out=lambda s: None)
    losses = [json.loads(x)["loss"] for x in (cfg.run_dir / "log.jsonl").read_text().splitlines()]
    return losses, load_file(str(result.adapter))


def assert_same_run(a, b) -> None:
    assert a[0] == b[0]  # the same loss curve, bit for bit
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def q(p: Path) -> str:
    return json.dumps(str(p))


@pytest.fixture(scope="module")
def flux_files(tmp_path_factory) -> dict[str, Path]:
    tiny = ensure_tiny(registry.get("flux"))
    d = tmp_path_factory.mktemp("flux-files")
    return {"transformer": write_bfl_flux(tiny, d / "flux1-dev.safetensors"),
            "clip_l": write_clip_l(tiny, d / "clip_l.safetensors"),
            "t5": write_t5xxl(tiny, d / "t5xxl_fp32.safetensors", dtype=torch.float32),
            "ae": write_flux_ae(tiny, d / "ae.safetensors")}


@pytest.mark.slow
def test_sdxl_from_one_checkpoint_trains_exactly_as_from_the_folder(tmp_path: Path, sample_dataset: Path) -> None:
    tiny = ensure_tiny(registry.get("sdxl"))
    ckpt = write_sgm_sdxl(tiny, tmp_path / "my_finetune.safetensors")
    folder = trained(preset("sdxl", tmp_path, sample_dataset, "run.name=folder"))
    cfg = preset("sdxl", tmp_path, sample_dataset, "run.name=file", f"model.path={q(ckpt)}", f"model.config={q(tiny)}")
    assert_same_run(trained(cfg), folder)
    rec = record.read_records(cfg.run_dir, "train")[-1]
    assert rec["model_source"]["files"] == {"checkpoint": str(ckpt)}
    assert list(rec["model_checksums"]) == ["checkpoint:my_finetune.safetensors"]
    assert rec["model_checksums"]["checkpoint:my_finetune.safetensors"] == record.sha256_file(ckpt)
    assert rec["model_facts"]["prediction_type"] == "epsilon"


def test_a_v_prediction_checkpoint_trains_v_prediction(tmp_path: Path, sample_dataset: Path) -> None:
    tiny = ensure_tiny(registry.get("sdxl"))
    ckpt = write_sgm_sdxl(tiny, tmp_path / "vpred.safetensors", v_pred=True)
    cfg = preset("sdxl", tmp_path, sample_dataset, "train.max_steps=1", f"model.path={q(ckpt)}",
                 f"model.config={q(tiny)}")
    family = registry.get("sdxl")
    src = resolve_model(cfg.model, family)
    trainable = family.load_trainable(src, cfg, torch.device("cpu"), torch.float32, resolve_swap(family, cfg, src))
    assert trainable.prediction_type == "v_prediction"
    over = preset("sdxl", tmp_path, sample_dataset, f"model.path={q(ckpt)}", f"model.config={q(tiny)}",
                  'sdxl.prediction_type="epsilon"')
    src = resolve_model(over.model, family)
    assert family.load_trainable(src, over, torch.device("cpu"), torch.float32,
                                 resolve_swap(family, over, src)).prediction_type == "epsilon"


@pytest.mark.slow
def test_flux_from_its_four_files_trains_exactly_as_from_the_folder(tmp_path: Path, sample_dataset: Path,
                                                                     flux_files) -> None:
    # tiny-flux has the FP8 base and 4 swapped blocks on: blocks are quantized as they are read.
    folder = trained(preset("flux", tmp_path, sample_dataset, "run.name=folder"))
    f = flux_files
    cfg = preset("flux", tmp_path, sample_dataset, "run.name=files", f"model.path={q(f['transformer'])}",
                 f"model.text_encoder={q(f['clip_l'])}", f"model.text_encoder_2={q(f['t5'])}",
                 f"model.vae={q(f['ae'])}", f"model.config={q(ensure_tiny(registry.get('flux')))}")
    assert_same_run(trained(cfg), folder)
    rec = record.read_records(cfg.run_dir, "train")[-1]
    assert set(rec["model_source"]["files"]) == {"transformer", "text_encoder", "text_encoder_2", "vae"}
    assert rec["memory"]["fp8"]["quantized_layers"] == \
        record.read_records(tmp_path / "runs" / "folder", "train")[-1]["memory"]["fp8"]["quantized_layers"]


def flux_from_files(tmp_path: Path, sample_dataset: Path, f: dict[str, Path], *extra: str):
    return preset("flux", tmp_path, sample_dataset, f"model.path={q(f['transformer'])}",
                  f"model.text_encoder={q(f['clip_l'])}", f"model.text_encoder_2={q(f['t5'])}",
                  f"model.vae={q(f['ae'])}", f"model.config={q(ensure_tiny(registry.get('flux')))}", *extra)


@pytest.mark.slow
def test_the_quantized_transformer_is_cached_and_the_next_run_reads_it(tmp_path: Path, sample_dataset: Path,
                                                                       flux_files, caplog) -> None:
    first_cfg = flux_from_files(tmp_path, sample_dataset, flux_files, "run.name=first")
    first = trained(first_cfg)
    facts = record.read_records(first_cfg.run_dir, "train")[-1]["model_facts"]["quantized_cache"]
    entry = Path(facts["entry"])
    assert facts["hit"] is False and facts["bytes"] > 0 and entry.parent == tmp_path / "cache" / "quantized"
    blocks = sorted(p.name for p in entry.glob("*transformer_blocks.*.safetensors"))
    config = json.loads((ensure_tiny(registry.get("flux")) / "transformer" / "config.json").read_text())
    assert len(blocks) == config["num_layers"] + config["num_single_layers"]  # one file per block
    assert (entry / "rest.safetensors").is_file()
    # Blocks were quantized as they were read (not later, as a whole): the entry holds them in fp8.
    block = load_file(str(entry / blocks[0]))
    fp8 = [k for k, v in block.items() if v.dtype == torch.float8_e4m3fn]
    assert fp8 and all(k.endswith(".weight._data") for k in fp8)
    assert not any(k.endswith("to_q.weight") for k in block)
    assert not list(entry.parent.glob("*.partial-*"))

    second_cfg = flux_from_files(tmp_path, sample_dataset, flux_files, "run.name=second")
    assert_same_run(trained(second_cfg), first)  # read back bit for bit: the same run
    rec = record.read_records(second_cfg.run_dir, "train")[-1]
    assert rec["model_facts"]["quantized_cache"] == {"entry": str(entry), "hit": True}
    assert rec["memory"]["fp8"]["quantized_layers"] == \
        record.read_records(first_cfg.run_dir, "train")[-1]["memory"]["fp8"]["quantized_layers"]

    # A damaged entry (a block file cut short) is said to be so, rebuilt, and the run is unchanged.
    victim = entry / blocks[0]
    victim.write_bytes(victim.read_bytes()[:100])
    with caplog.at_level("WARNING"):
        third_cfg = flux_from_files(tmp_path, sample_dataset, flux_files, "run.name=third")
        assert_same_run(trained(third_cfg), first)
    assert "damaged" in caplog.text and blocks[0] in caplog.text
    assert record.read_records(third_cfg.run_dir, "train")[-1]["model_facts"]["quantized_cache"]["hit"] is False
    assert victim.stat().st_size > 100

    # The cache can be turned off; another weight dtype is another entry.
    off = flux_from_files(tmp_path, sample_dataset, flux_files, "run.name=off", "cache.quantized_base=false")
    trained(off)
    assert "quantized_cache" not in record.read_records(off.run_dir, "train")[-1]["model_facts"]
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]


def test_flux_named_by_bare_names_in_a_comfyui_folder(tmp_path: Path, sample_dataset: Path, flux_files) -> None:
    shared = tmp_path / "shared"
    comfy = make_comfyui_tree(tmp_path / "ComfyUI", {
        "models/unet/flux1-dev.safetensors": flux_files["transformer"],  # the legacy folder name
        "models/clip/clip_l.safetensors": flux_files["clip_l"],
        "models/vae/ae.safetensors": flux_files["ae"]})
    (shared / "te").mkdir(parents=True)
    (shared / "te" / "t5xxl_fp32.safetensors").write_bytes(flux_files["t5"].read_bytes())
    (comfy / "extra_model_paths.yaml").write_text(f"mine:\n  base_path: {shared}\n  text_encoders: te\n")
    cfg = preset("flux", tmp_path, sample_dataset, "train.max_steps=1", f"model.comfyui={q(comfy)}",
                 'model.path="flux1-dev.safetensors"', 'model.text_encoder="clip_l.safetensors"',
                 'model.text_encoder_2="t5xxl_fp32.safetensors"', 'model.vae="ae.safetensors"',
                 f"model.config={q(ensure_tiny(registry.get('flux')))}")
    src = resolve_model(cfg.model, registry.get("flux"))
    assert src.files["transformer"] == comfy / "models" / "unet" / "flux1-dev.safetensors"
    assert src.files["text_encoder_2"] == shared / "te" / "t5xxl_fp32.safetensors"
    assert train(cfg, out=lambda s: None).adapter.is_file()
    with pytest.raises(ModelSourceError, match=r"model.vae = 'missing.safetensors': .*not in ComfyUI's vae folders"):
        resolve_model(cfg.replace(model={"vae": "missing.safetensors"}).model, registry.get("flux"))


def test_wrong_files_are_named_before_anything_loads(tmp_path: Path, flux_files) -> None:
    sdxl, flux = registry.get("sdxl"), registry.get("flux")
    base = preset("flux", tmp_path, tmp_path)

    def model(**kw):
        return base.replace(model=kw).model

    with pytest.raises(ModelSourceError, match=r'flux1-dev.safetensors is not an SDXL checkpoint .*; it looks like flux-transformer .*set model.family = "flux"'):
        resolve_model(model(path=str(flux_files["transformer"])), sdxl)
    with pytest.raises(ModelSourceError, match=r"ae.safetensors is not a FLUX.1 transformer .*; it looks like vae-flux"):
        resolve_model(model(path=str(flux_files["ae"])), flux)
    with pytest.raises(ModelSourceError, match=r"FLUX also needs its text encoders and VAE as files: set "
                                               r"model.text_encoder \(e.g. clip_l.safetensors\), model.text_encoder_2"):
        resolve_model(model(path=str(flux_files["transformer"])), flux)
    with pytest.raises(ModelSourceError, match=r"clip_l.safetensors is not a T5-XXL text encoder"):
        resolve_model(model(path=str(flux_files["transformer"]), text_encoder=str(flux_files["clip_l"]),
                            text_encoder_2=str(flux_files["clip_l"]), vae=str(flux_files["ae"])), flux)
    lora = tmp_path / "my_lora.safetensors"
    from safetensors.torch import save_file

    save_file({"lora_unet_x.lora_up.weight": torch.zeros(2, 2)}, str(lora))
    with pytest.raises(ModelSourceError, match=r"my_lora.safetensors is a LoRA .* not a base model"):
        resolve_model(model(path=str(lora)), flux)
    pickle = tmp_path / "model.ckpt"
    pickle.write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(ModelSourceError, match=r"(?s)model.ckpt is a pickle file; imglora loads weights from "
                                               r".safetensors files only.*torch.load"):
        resolve_model(model(path=str(pickle)), flux)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(flux_files["transformer"].read_bytes()[:5000])
    with pytest.raises(ModelSourceError, match=r"cut.safetensors is not a readable safetensors file .*5,000 bytes"):
        resolve_model(model(path=str(cut)), flux)


def test_configs_ship_and_tokenizers_come_from_comfyui_or_a_named_download(tmp_path: Path, flux_files,
                                                                           monkeypatch) -> None:
    from imglora.families._shared.singlefile import configdir

    monkeypatch.setattr(configdir, "hub_snapshot", lambda repo: None)  # an empty Hugging Face cache
    monkeypatch.setenv("IMGLORA_HOME", str(tmp_path / "home"))
    flux = registry.get("flux")
    parts = dict(path=str(flux_files["transformer"]), text_encoder=str(flux_files["clip_l"]),
                 text_encoder_2=str(flux_files["t5"]), vae=str(flux_files["ae"]))
    base = preset("flux", tmp_path, tmp_path)
    with pytest.raises(ModelSourceError, match=r"FLUX's CLIP-L's tokenizer is not on this machine.*`hf download "
                                               r"black-forest-labs/FLUX.1-dev --include 'tokenizer/\*'`.*model.comfyui"):
        resolve_model(base.replace(model=parts).model, flux)
    comfy = make_comfyui_tree(tmp_path / "ComfyUI", {})
    src = resolve_model(base.replace(model={**parts, "comfyui": str(comfy)}).model, flux)
    # The real FLUX.1-dev architecture (the file is "dev": it has guidance weights), ComfyUI's tokenizers.
    t = json.loads((src.root / "transformer" / "config.json").read_text())
    assert (t["num_layers"], t["num_single_layers"], t["guidance_embeds"]) == (19, 38, True)
    from transformers import CLIPTokenizer, T5TokenizerFast

    clip = CLIPTokenizer.from_pretrained(src.root, subfolder="tokenizer")
    assert clip.model_max_length == 77  # ComfyUI's copy says 8192
    assert T5TokenizerFast.from_pretrained(src.root, subfolder="tokenizer_2")("a red ball").input_ids[-1] == 1
    assert resolve_model(base.replace(model={**parts, "comfyui": str(comfy)}).model, flux).root == src.root  # reused


def test_the_export_names_the_checkpoint_and_its_workflow_loads_it(tmp_path: Path, sample_dataset: Path) -> None:
    import hashlib

    from imglora.commands.export import export

    tiny = ensure_tiny(registry.get("sdxl"))
    comfy = make_comfyui_tree(tmp_path / "ComfyUI", {})
    ckpt = write_sgm_sdxl(tiny, comfy / "models" / "checkpoints" / "ponyish_v6.safetensors")
    cfg = preset("sdxl", tmp_path, sample_dataset, "train.max_steps=1", f"model.comfyui={q(comfy)}",
                 'model.path="ponyish_v6.safetensors"', f"model.config={q(tiny)}")
    train(cfg, out=lambda s: None)
    res = export(cfg.run_dir, comfyui=comfy, name="toy")
    meta = res.metadata
    assert meta["ss_sd_model_name"] == "ponyish_v6.safetensors"
    assert meta["ss_new_sd_model_hash"] == record.sha256_file(ckpt)
    with open(ckpt, "rb") as fh:
        fh.seek(0x100000)
        assert meta["ss_sd_model_hash"] == hashlib.sha256(fh.read(0x10000)).hexdigest()[:8]
    api = json.loads(res.workflow_api.read_text())
    assert api["1"]["inputs"]["ckpt_name"] == "ponyish_v6.safetensors"  # the file trained on, by its ComfyUI name


def kontext_preset(tmp_path: Path, *extra: str):
    """tiny-flux-kontext on two of the sample edit pairs."""
    edits = REPO / "sample_datasets"
    return preset("flux_kontext", tmp_path, edits / "edit_toy", f"data.control_dir={q(edits / 'edit_toy_sources')}",
                  *extra)


@pytest.mark.slow  # (the default run keeps under 6 minutes; CI runs it)
def test_flux_kontext_from_comfyuis_files_trains_exactly_as_from_the_folder(tmp_path: Path, monkeypatch) -> None:
    """flux1-kontext-dev.safetensors (BFL's layout, like FLUX.1-dev's) with clip_l, t5xxl and ae found
    by bare name in a ComfyUI folder; without model.config the shipped Kontext configs are used."""
    from imglora.families._shared.singlefile import configdir

    tiny = ensure_tiny(registry.get("flux_kontext"))
    d = tmp_path / "files"
    files = {"models/diffusion_models/flux1-kontext-dev.safetensors": write_bfl_flux(tiny, d / "k.safetensors"),
             "models/text_encoders/clip_l.safetensors": write_clip_l(tiny, d / "clip_l.safetensors"),
             "models/text_encoders/t5xxl_fp32.safetensors": write_t5xxl(tiny, d / "t5.safetensors",
                                                                       dtype=torch.float32),
             "models/vae/ae.safetensors": write_flux_ae(tiny, d / "ae.safetensors")}
    comfy = make_comfyui_tree(tmp_path / "ComfyUI", files)
    names = [f"model.comfyui={q(comfy)}", 'model.path="flux1-kontext-dev.safetensors"',
             'model.text_encoder="clip_l.safetensors"', 'model.text_encoder_2="t5xxl_fp32.safetensors"',
             'model.vae="ae.safetensors"']
    kontext = registry.get("flux_kontext")
    monkeypatch.setattr(configdir, "hub_snapshot", lambda repo: None)  # an empty Hugging Face cache
    monkeypatch.setenv("IMGLORA_HOME", str(tmp_path / "home"))
    shipped = resolve_model(kontext_preset(tmp_path, *names).model, kontext)
    assert json.loads((shipped.root / "model_index.json").read_text())["_class_name"] == "FluxKontextPipeline"
    t = json.loads((shipped.root / "transformer" / "config.json").read_text())
    assert (t["num_layers"], t["num_single_layers"], t["guidance_embeds"]) == (19, 38, True)  # FLUX.1-dev's
    schnell = {k: v for k, v in load_file(str(d / "k.safetensors")).items() if not k.startswith("guidance_in.")}
    from safetensors.torch import save_file

    save_file(schnell, comfy / "models" / "diffusion_models" / "schnell.safetensors")
    with pytest.raises(ModelSourceError, match=r"schnell.safetensors is a FLUX.1-schnell transformer .*"
                                               r"flux1-kontext-dev is built on FLUX.1-dev"):
        resolve_model(kontext_preset(tmp_path, *names).replace(model={"path": "schnell.safetensors"}).model, kontext)

    folder = trained(kontext_preset(tmp_path, "run.name=folder", "train.max_steps=2"))
    from_files = trained(kontext_preset(tmp_path, "run.name=files", "train.max_steps=2", *names,
                                        f"model.config={q(tiny)}"))
    assert_same_run(from_files, folder)


@pytest.mark.slow
def test_chroma_from_comfyuis_files_trains_exactly_as_from_the_folder(tmp_path: Path, sample_dataset: Path,
                                                                      monkeypatch) -> None:
    """Chroma1-HD.safetensors (BFL's layout, as diffusers' own converter reads it), t5xxl and ae found
    by bare name in a ComfyUI folder, the shipped Chroma1-HD configs with ComfyUI's T5 tokenizer."""
    from safetensors.torch import save_file

    from imglora.families._shared.singlefile import configdir

    tiny = ensure_tiny(registry.get("chroma"))
    d = tmp_path / "files"
    chroma_file = write_bfl_chroma(tiny, d / "c.safetensors")
    comfy = make_comfyui_tree(tmp_path / "ComfyUI", {
        "models/diffusion_models/Chroma1-HD.safetensors": chroma_file,
        "models/text_encoders/t5xxl_fp32.safetensors": write_t5xxl(tiny, d / "t5.safetensors", dtype=torch.float32,
                                                                   sub="text_encoder"),
        "models/vae/ae.safetensors": write_flux_ae(tiny, d / "ae.safetensors")})
    names = [f"model.comfyui={q(comfy)}", 'model.path="Chroma1-HD.safetensors"',
             'model.text_encoder="t5xxl_fp32.safetensors"', 'model.vae="ae.safetensors"']
    chroma = registry.get("chroma")
    monkeypatch.setattr(configdir, "hub_snapshot", lambda repo: None)  # an empty Hugging Face cache
    monkeypatch.setenv("IMGLORA_HOME", str(tmp_path / "home"))
    shipped = resolve_model(preset("chroma", tmp_path, sample_dataset, *names).model, chroma)
    t = json.loads((shipped.root / "transformer" / "config.json").read_text())
    assert (t["num_layers"], t["num_single_layers"], t["approximator_hidden_dim"]) == (19, 38, 5120)
    with pytest.raises(ModelSourceError, match=r"is a Chroma transformer alone; Chroma also needs T5-XXL and "
                                               r"FLUX's VAE as files: set model.vae \(e.g. ae.safetensors\)"):
        resolve_model(preset("chroma", tmp_path, sample_dataset, *names[:3]).model, chroma)
    flux_file = write_bfl_flux(ensure_tiny(registry.get("flux")), d / "flux1-dev.safetensors")
    save_file(load_file(str(flux_file)), comfy / "models" / "diffusion_models" / "flux1-dev.safetensors")
    with pytest.raises(ModelSourceError, match=r"flux1-dev.safetensors is not a Chroma transformer.*"
                                               r"model.family = \"flux\""):
        resolve_model(preset("chroma", tmp_path, sample_dataset, *names).replace(
            model={"path": "flux1-dev.safetensors"}).model, chroma)

    # tiny-chroma has the FP8 base and 2 swapped blocks on: blocks are quantized as they are read.
    folder = trained(preset("chroma", tmp_path, sample_dataset, "run.name=folder", "train.max_steps=2"))
    from_files = trained(preset("chroma", tmp_path, sample_dataset, "run.name=files", "train.max_steps=2", *names,
                                f"model.config={q(tiny)}"))
    assert_same_run(from_files, folder)


@pytest.mark.slow  # (the default run keeps under 6 minutes; CI runs it)
def test_chromas_key_plan_is_diffusers_converter_read_backwards() -> None:
    """diffusers' convert_chroma_transformer_checkpoint_to_diffusers hard-codes Chroma's width (3072),
    so the check runs at the real width with one block of each kind and int8 values (the conversion
    only slices and concatenates): the BFL state our plan describes converts back exactly."""
    from diffusers import ChromaTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers

    from imglora.families.chroma.singlefile import chroma_plan

    config = {"num_layers": 1, "num_single_layers": 1, "approximator_layers": 1}
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in ChromaTransformer2DModel(**config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    ours = {k: torch.randint(-128, 127, shape, generator=g, dtype=torch.int8) for k, shape in shapes.items()}
    bfl: dict[str, list[tuple[int, torch.Tensor]]] = {}
    plan = chroma_plan(dict(ChromaTransformer2DModel.load_config(str(REPO / "src/imglora/families/chroma/configs/"
                                                                          "chroma1-hd/transformer")), **config))
    assert plan.keys() == shapes.keys()
    for key, (src, rows, _op) in plan.items():
        bfl.setdefault(src, []).append((rows[0] if rows else 0, ours[key]))
    file_state = {k: torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]) for k, parts in bfl.items()}
    theirs = convert_chroma_transformer_checkpoint_to_diffusers(file_state)
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)

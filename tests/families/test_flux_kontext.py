"""FLUX.1 Kontext [dev]: edit pairs trained as FluxKontextPipeline builds its input, resumed
exactly, evaluated from each prompt's source image, exported as ComfyUI loads it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from imglora.export import workflows as comfyui
from imglora.commands.common import load_config
from imglora.commands.evaluate import evaluate
from imglora.commands.train import train
from imglora.data import cache
from imglora.data.buckets import fit_to_bucket
from imglora.data.images import open_image
from imglora.errors import ImgloraError
from imglora.families import registry
from imglora.families._shared import flow_matching
from imglora.models.resolve import resolve_model
from loading import load_tiny
from resume_exact import assert_resumes_exactly

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-flux-kontext.toml"
EDITS = REPO / "sample_datasets" / "edit_toy"
SOURCES = REPO / "sample_datasets" / "edit_toy_sources"


def pairs(root: Path, stems=("01_sky", "03_table")) -> tuple[Path, Path]:
    data, sources = root / "data", root / "sources"
    data.mkdir(parents=True)
    sources.mkdir()
    for stem in stems:
        for f in EDITS.glob(f"{stem}.*"):
            shutil.copy(f, data / f.name)
        shutil.copy(SOURCES / f"{stem}.png", sources / f"{stem}.png")
    return data, sources


def preset(root: Path, data: Path, sources: Path, *extra: str):
    q = lambda p: json.dumps(str(p))  # noqa: E731
    return load_config(PRESET, [f"data.dir={q(data)}", f"data.control_dir={q(sources)}",
                                f"cache.dir={q(root / 'cache')}", f"run.output_dir={q(root / 'runs')}",
                                "train.max_steps=4", "train.warmup_steps=0", "train.log_every=1",
                                "train.checkpoint_every=2", *extra])


class Fixed:
    """``imglora.util.rng.draws`` standing in: the given noise and noise level, so the reference below
    sees the very tensors the loss drew."""

    def __init__(self, noise: torch.Tensor, sigma: torch.Tensor):
        self.noise, self.sigma = noise, sigma

    def randn(self, shape, device=None, dtype=None):
        return self.noise.reshape(shape).to(dtype or torch.float32)

    def rand(self, shape, device=None):
        return self.sigma


def test_the_loss_is_flux_kontext_pipelines_input_and_target(tmp_path: Path, monkeypatch) -> None:
    from diffusers import FluxKontextPipeline

    from imglora.util.owned import own_module

    data, sources = pairs(tmp_path, stems=("03_table",))  # a landscape image: a non-square bucket
    cfg = preset(tmp_path, data, sources, 'flux_kontext.timestep_sampling="uniform"', "memory.fp8=false",
                 "memory.blocks_to_swap=0")
    family = registry.get("flux_kontext")
    src = resolve_model(cfg.model.path, family)
    the_plan, _ = cache.fill_cache(cfg, family, src, "cpu", progress=False)
    (sample,) = cache.load_samples(cfg, family, src, "cpu", the_plan)
    entry = sample.variants[0]
    w, h = sample.bucket
    assert entry["control_latents"].shape == (1, 16, h // 8, w // 8) and entry["latents"].shape == (16, h // 8, w // 8)

    pipe = FluxKontextPipeline.from_pretrained(src.root)
    own_module(pipe.vae)  # in aligned memory, as imglora holds it (see tests/commands/test_evaluate.py)
    trainable = load_tiny(family, src, cfg)
    pipe.transformer = trainable.model.eval()
    # The pipeline's own encoding of the source image fitted to the bucket (its preprocess, its VAE
    # call, its packing and ids), and of the target as the cache holds it.
    fitted = fit_to_bucket(open_image(sources / "03_table.png"), (w, h)).image
    pixels = torch.from_numpy(np.asarray(fitted, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)[None]
    # The pipeline's preprocessing gives the same values; it lays them out contiguously, where the
    # cache's tensor is a permuted view, and CPU convolutions round differently per layout (1e-5 in
    # the latents), so the values are checked here and the cache's layout is encoded below.
    assert torch.equal(pipe.image_processor.preprocess(fitted, h, w), pixels)
    target = fit_to_bucket(open_image(data / "03_table.jpg"), (w, h)).image
    target = torch.from_numpy(np.asarray(target, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)[None]
    with torch.no_grad():
        assert torch.equal(pipe._encode_vae_image(target, None), entry["latents"][None])
    x0 = pipe._pack_latents(entry["latents"][None], 1, 16, h // 8, w // 8)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(3))
    sigma = torch.tensor([0.37])
    _, image_latents, latent_ids, image_ids = pipe.prepare_latents(pixels, 1, 16, h, w, torch.float32,
                                                                   torch.device("cpu"), latents=noise)
    assert image_ids[:, 0].eq(1).all() and latent_ids[:, 0].eq(0).all()
    with torch.no_grad():
        pred = pipe.transformer(
            hidden_states=torch.cat([(1 - sigma) * x0 + sigma * noise, image_latents], dim=1), timestep=sigma,
            guidance=torch.full((1,), cfg.family.guidance), pooled_projections=entry["pooled_prompt_embeds"][None],
            encoder_hidden_states=entry["prompt_embeds"][None], txt_ids=torch.zeros(32, 3),
            img_ids=torch.cat([latent_ids, image_ids]), return_dict=False)[0][:, :x0.shape[1]]
        reference = torch.nn.functional.mse_loss(pred, noise - x0)
        monkeypatch.setattr(flow_matching, "draws", lambda generator: Fixed(noise, sigma))
        ours = trainable.loss({k: v[None] for k, v in entry.items()}, torch.Generator())
    assert torch.equal(pipe._pack_latents(entry["control_latents"], 1, 16, h // 8, w // 8), image_latents)
    assert torch.equal(ours, reference)  # the same transformer on the same tensors, built the same way
    assert trainable.facts["variant"] == "kontext-dev"


def test_pairs_are_checked_and_the_source_keys_the_cache(tmp_path: Path) -> None:
    data, sources = pairs(tmp_path)
    cfg = preset(tmp_path, data, sources)
    family = registry.get("flux_kontext")
    src = resolve_model(cfg.model.path, family)
    (sources / "._01_sky.png").write_bytes(b"macOS metadata")  # hidden files are no sources, as no images
    first = cache.plan(cfg, family, src, "cpu")
    assert [s.item.controls for s in first.latents] == [(sources / "01_sky.png",), (sources / "03_table.png",)]
    version = family.data_version(cfg)
    Image.open(sources / "01_sky.png").rotate(90).save(sources / "01_sky.png")  # another source, same name
    second = cache.plan(cfg, family, src, "cpu")
    assert first.latents[0].key != second.latents[0].key and first.latents[1].key == second.latents[1].key
    assert family.data_version(cfg) != version  # so --resume refuses to go on with other pairs
    Image.open(sources / "01_sky.png").resize((64, 128)).save(sources / "01_sky.png")
    assert not any("aspect ratio" in w for w in second.scan.warnings)
    warnings = cache.plan(cfg, family, src, "cpu").scan.warnings
    assert any("1 source image(s) have another aspect ratio than their training image and are cropped to its "
               "bucket, so the pair may no longer line up: 01_sky.png 64x128 for 01_sky.png 512x512" in w
               for w in warnings), warnings

    (sources / "03_table.png").rename(sources / "03_tabel.png")
    with pytest.raises(ImgloraError) as exc:
        cache.plan(cfg, family, src, "cpu")
    assert f"{sources}: 1 training image(s) have no source image in data.control_dir: 03_table.jpg" in str(exc.value)
    shutil.copy(sources / "03_tabel.png", sources / "03_table.webp")
    with pytest.raises(ImgloraError, match=r"1 source image\(s\) in data.control_dir match no training image: "
                                           r"03_tabel.png; a source image needs the file stem"):
        cache.plan(cfg, family, src, "cpu")


def test_a_held_out_image_never_takes_a_training_images_source(tmp_path: Path) -> None:
    data, sources = pairs(tmp_path)
    held = tmp_path / "held"
    held.mkdir()
    shutil.copy(EDITS / "01_sky.png", held / "01_sky.png")  # the name of a training image
    shutil.copy(EDITS / "01_sky.txt", held / "01_sky.txt")
    cfg = preset(tmp_path, data, sources, f"eval.holdout_dir={json.dumps(str(held))}")
    with pytest.raises(ImgloraError, match=r"1 held-out image\(s\) have the file name of a training image, so they "
                                           r"would take its source image from data.control_dir: 01_sky.png"):
        registry.get("flux_kontext").data_version(cfg)


def test_a_second_evaluation_of_a_step_replaces_the_first(tmp_path: Path) -> None:
    from imglora.runs import sheets

    grid = [[Image.new("RGB", (32, 32), c) for c in ("red", "blue")]]
    source = [Image.new("RGB", (32, 32), "grey")]
    for _ in range(2):
        paths, sheet = sheets.write_outputs(tmp_path, grid, ["p"], [0.0, 1.0], "t", controls=source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["contact_sheet.png", "p0_s0.png", "p0_s1.png",
                                                          "p0_source.png"]
    assert Image.open(tmp_path / "p0_source.png").getpixel((0, 0)) == (128, 128, 128)


def test_the_config_asks_for_sources_where_they_belong(tmp_path: Path) -> None:
    from imglora.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data.control_dir: missing required key for the flux_kontext family"):
        load_config(PRESET, ['data.control_dir=""'])
    with pytest.raises(ConfigError, match=r"data.control_dir: source images are for the edit-model families "
                                          r"\(flux_kontext, qwen_image_edit, qwen_image_edit_plus\); the flux family trains on images alone"):
        load_config(REPO / "presets" / "tiny-flux.toml", ['data.control_dir="x"'])
    with pytest.raises(ConfigError, match=r"data.control_path: unknown key \(that is another trainer's name; imglora's is control_dir\)"):
        load_config(PRESET, ['data.control_path="x"'])


@pytest.fixture(scope="module")
def kontext_run(tmp_path_factory):
    """4 updates with the preset's FP8 base and 4 swapped blocks, a checkpoint every 2."""
    root = tmp_path_factory.mktemp("kontext")
    data, sources = pairs(root)
    cfg = preset(root, data, sources, 'eval.strengths=[0, 1]', "eval.sample_steps=2")
    assert cfg.memory.fp8 and cfg.memory.blocks_to_swap == 4
    return cfg, train(cfg, out=lambda s: None)


def test_a_resumed_run_ends_exactly_as_an_uninterrupted_one(kontext_run, tmp_path: Path) -> None:
    cfg, result = kontext_run
    assert_resumes_exactly(cfg, result, tmp_path)


def test_eval_samples_from_each_prompts_source_and_strength_0_is_the_base_pipeline(kontext_run) -> None:
    import diffusers

    from imglora.util.owned import own_module

    cfg, _ = kontext_run
    plain = ['eval.fp8="off"', "eval.blocks_to_swap=0"]
    result = evaluate(cfg.run_dir, overrides=plain, out=lambda s: None)
    (step,) = result.images
    prompts = registry.get("flux_kontext").default_prompts(cfg)
    assert prompts[0] == (EDITS / "01_sky.txt").read_text().strip()
    folder = result.sheets[step].parent
    side = cfg.data.resolution
    expected = fit_to_bucket(open_image(SOURCES / "01_sky.png"), (side, side)).image
    assert np.array_equal(np.asarray(Image.open(folder / "p0_source.png")), np.asarray(expected))
    assert Image.open(folder / "p0_s0.png").size == (side, side)
    sheet = Image.open(result.sheets[step])  # a label column, the source, two strengths: 192-px cells
    assert sheet.width > 4 * 192 and Image.open(folder / "p1_source.png").size == (side, side)

    pipe = diffusers.FluxKontextPipeline.from_pretrained(resolve_model("tiny:flux_kontext",
                                                                       registry.get("flux_kontext")).root)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            own_module(component)
    pipe.set_progress_bar_config(disable=True)
    base = pipe(prompt=prompts[0], image=expected, height=side, width=side, num_inference_steps=2, guidance_scale=2.5,
                max_sequence_length=32, _auto_resize=False, max_area=side * side, generator=torch.Generator().manual_seed(0)).images[0]
    assert np.array_equal(np.asarray(Image.open(result.images[step][0][0]).convert("RGB")), np.asarray(base))
    assert not np.array_equal(np.asarray(Image.open(result.images[step][0][1]).convert("RGB")), np.asarray(base))


def test_eval_prompts_need_their_source_images(kontext_run) -> None:
    cfg, _ = kontext_run
    family = registry.get("flux_kontext")
    from imglora.families._shared.diffusers_image import source_images

    with pytest.raises(ImgloraError, match=r"1 evaluation prompt\(s\) are no training image's caption.*"
                                           r"'a red ball'.*eval.control_images"):
        source_images(family, cfg, ["a red ball"])
    two = cfg.replace(eval={"control_images": [str(SOURCES / "01_sky.png"), str(SOURCES / "02_grass.png")]})
    with pytest.raises(ImgloraError, match=r"eval.control_images has 2 images for 3 prompts"):
        source_images(family, two, ["a", "b", "c"])
    grass = source_images(family, two, ["make it red", "make it blue"])
    assert grass[1].size == (128, 128) and grass[0].tobytes() != grass[1].tobytes()


def test_the_export_is_fluxs_and_the_workflow_references_the_source(kontext_run, tmp_path: Path) -> None:
    from imglora.commands.export import export as export_run

    cfg, result = kontext_run  # (tests/export/test_writer.py maps a Kontext export through ComfyUI's loader)
    exported = export_run(cfg.run_dir, out=tmp_path / "k.safetensors", dtype="fp32")
    tensors = load_file(str(exported.path))
    trained = load_file(str(result.adapter))
    n_modules = len({k.rsplit(".lora_", 1)[0] for k in trained})
    assert sum(k.endswith(".alpha") for k in tensors) == n_modules and len(tensors) == 3 * n_modules
    api = json.loads(exported.path.with_suffix(".workflow-api.json").read_text())
    by_type = {n["class_type"]: (k, n["inputs"]) for k, n in api.items()}
    assert by_type["UNETLoader"][1]["unet_name"] == "flux1-kontext-dev.safetensors"
    ref_id, ref = by_type["ReferenceLatent"]
    assert api[ref["conditioning"][0]]["class_type"] == "CLIPTextEncode"
    assert api[ref["latent"][0]]["class_type"] == "VAEEncode"
    assert by_type["FluxGuidance"][1]["conditioning"] == [ref_id, 0] and by_type["FluxGuidance"][1]["guidance"] == 2.5
    assert api[by_type["KSampler"][1]["latent_image"][0]]["class_type"] == "VAEEncode"
    assert "EmptySD3LatentImage" not in by_type
    for node in api.values():  # every link names a node
        for value in node["inputs"].values():
            if isinstance(value, list):
                assert value[0] in api
    ui = comfyui.to_ui(registry.get("flux_kontext").comfyui_nodes("k.safetensors", "a", "", 0, "x", False))
    ids = {n["id"] for n in ui["nodes"]}
    assert all(src in ids and dst in ids for _, src, _, dst, _, _ in ui["links"])

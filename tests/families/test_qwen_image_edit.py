"""Qwen-Image-Edit and Edit Plus (2509/2511): captions cached as the Edit pipelines encode them with
the source image(s) (Qwen2.5-VL reads both; the template's 64 tokens dropped), one text entry per
image keyed by its sources' bytes, the loss as the transformer computes it when the pipeline calls it
(the sources' clean tokens appended, the prediction read for the noisy ones), flipped pairs and the
other Edit model's folder refused, the ComfyUI workflows, and a run that trains, evaluates from the
sources and exports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from imglora.commands.common import load_config
from imglora.export.workflows import to_api
from imglora.data import cache
from imglora.data.buckets import fit_to_bucket
from imglora.data.images import open_image
from imglora.errors import ImgloraError
from imglora.families import registry
from imglora.families._shared import flow_matching
from imglora.families.qwen_image_edit import model as edit_model
from imglora.models.resolve import resolve_model
from imglora.util.owned import own_module
from loading import load_tiny
from resume_exact import assert_resumes_exactly

REPO = Path(__file__).resolve().parents[2]
EDITS = REPO / "sample_datasets" / "edit_toy"
SOURCES = REPO / "sample_datasets" / "edit_toy_sources"
q = lambda p: json.dumps(str(p))  # noqa: E731


def edit_config(name: str, root: Path, stems=("01_sky", "03_table"), extra_sources: dict[str, int] | None = None,
                *overrides: str):
    """The family's tiny preset on some sample edit pairs in ``root`` (``extra_sources``: stem -> how
    many more sources, <stem>_1 ..., made from the others)."""
    data, sources = root / "data", root / "sources"
    data.mkdir(parents=True, exist_ok=True)
    sources.mkdir(exist_ok=True)
    for stem in stems:
        for f in EDITS.glob(f"{stem}.*"):
            shutil.copy(f, data / f.name)
        shutil.copy(SOURCES / f"{stem}.png", sources / f"{stem}.png")
        for k in range(1, (extra_sources or {}).get(stem, 0) + 1):
            shutil.copy(SOURCES / ("04_wall.png" if k == 1 else "02_grass.png"), sources / f"{stem}_{k}.png")
    return load_config(REPO / "presets" / f"tiny-{name.replace('_', '-')}.toml", [
        f"data.dir={q(data)}", f"data.control_dir={q(sources)}", f"cache.dir={q(root / 'cache')}",
        f"run.output_dir={q(root / 'runs')}", "memory.fp8=false", "memory.blocks_to_swap=0", "data.buckets=false",
        *overrides])


def pipeline(name: str, src, encoders):
    import diffusers

    family = registry.get(name)
    pipe = getattr(diffusers, family.pipeline).from_pretrained(src.root, processor=encoders[0],
                                                               text_encoder=encoders[1])
    for m in (pipe.vae, pipe.transformer):
        own_module(m)
    return pipe


@pytest.fixture(scope="module")
def plus(tmp_path_factory):
    """Edit Plus's tiny model on two pairs, the first with two sources, cached."""
    root = tmp_path_factory.mktemp("plus")
    cfg = edit_config("qwen_image_edit_plus", root, extra_sources={"01_sky": 1})
    family = registry.get("qwen_image_edit_plus")
    src = resolve_model(cfg.model.path, family)
    the_plan, stats = cache.fill_cache(cfg, family, src, "cpu", progress=False)
    return cfg, family, src, the_plan, stats


@pytest.mark.parametrize("name", ["qwen_image_edit", "qwen_image_edit_plus"])
def test_captions_are_the_pipelines_embeddings_of_caption_and_sources(name: str, tmp_path: Path) -> None:
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit_module
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus_module

    cfg = edit_config(name, tmp_path, stems=("01_sky",))
    family = registry.get(name)
    src = resolve_model(cfg.model.path, family)
    encoders = family.load_text_encoders(src, torch.device("cpu"), torch.float32)
    pipe = pipeline(name, src, encoders)
    # The pipeline's template, and the tiny tokenizer cuts it where Qwen2.5's does: the system turn and
    # "<|im_start|>user\n" are 64 tokens (prompt_template_encode_start_idx).
    assert pipe.prompt_template_encode == (edit_model.TEMPLATE_PLUS if family.plus else edit_model.TEMPLATE)
    assert len(encoders[0].tokenizer(edit_model.SYSTEM).input_ids) == pipe.prompt_template_encode_start_idx == 64
    sources = [fit_to_bucket(open_image(SOURCES / f), (64, 96)).image for f in ("01_sky.png", "04_wall.png")]
    caption = "colour this black-and-white photo: sks toy"
    if family.plus:  # QwenImageEditPlusPipeline.__call__: each source at CONDITION_IMAGE_SIZE, "Picture i:" each
        views = []
        for image in sources:
            w, h = plus_module.calculate_dimensions(plus_module.CONDITION_IMAGE_SIZE, image.width / image.height)
            views.append(pipe.image_processor.resize(image, h, w))
        want, mask = pipe._get_qwen_prompt_embeds([caption], views, device=torch.device("cpu"))
        got = family.encode_text(encoders, caption, 1024, sources=sources)["prompt_embeds"]
    else:  # QwenImageEditPipeline.__call__: the source at the 1024² area it edits at
        w, h, _ = edit_module.calculate_dimensions(1024 * 1024, sources[0].width / sources[0].height)
        view = pipe.image_processor.resize(sources[0], h, w)
        want, mask = pipe._get_qwen_prompt_embeds([caption], view, device=torch.device("cpu"))
        got = family.encode_text(encoders, caption, 1024, sources=sources[:1])["prompt_embeds"]
    # One encoder and processor instance on the same inputs: the same tensors.
    assert torch.equal(got, want[0]) and bool(mask.all())
    # The image's vision tokens are inside: far more than the caption's.
    assert got.shape[0] > 100
    # cache.text_max_length cuts the caption's tokens, never the vision tokens.
    short = family.encode_text(encoders, caption, 2, sources=sources[:1])["prompt_embeds"]
    caption_tokens = len(encoders[0].tokenizer(caption).input_ids)
    assert short.shape[0] == family.encode_text(encoders, caption, 1024, sources=sources[:1])["prompt_embeds"].shape[0] \
        - (caption_tokens - 2)
    assert family.count_tokens(encoders, caption, 2) == {"Qwen2.5-VL": (caption_tokens, 2)}


def test_each_image_has_text_entries_keyed_by_its_sources(plus, tmp_path: Path) -> None:
    cfg, family, src, the_plan, stats = plus
    items = {i.path.stem: i for i in the_plan.scan.items}
    assert [p.name for p in items["01_sky"].controls] == ["01_sky.png", "01_sky_1.png"]
    assert stats.texts_encoded == len(the_plan.texts) == 2  # one per image (no caption variants in the preset)
    samples = cache.load_samples(cfg, family, src, "cpu", the_plan)
    by_stem = {s.variants[0]["control_latents"].shape[0]: s.variants[0] for s in samples}
    assert set(by_stem) == {1, 2}  # the first image has two sources: two sets of vision tokens
    assert by_stem[2]["prompt_embeds"].shape[0] > by_stem[1]["prompt_embeds"].shape[0]

    # A caption shared by two images is still two entries: each read with its own source.
    data = Path(cfg.data.dir)
    shared = load_config(REPO / "presets" / "tiny-qwen-image-edit-plus.toml", [
        f"data.dir={q(data)}", f"data.control_dir={q(cfg.data.control_dir)}", f"cache.dir={q(cfg.cache.dir)}",
        "data.buckets=false", "data.default_caption=\"same\"", "data.missing_caption=\"default\""])
    moved = tmp_path / "captions"
    moved.mkdir()
    for f in data.glob("*.txt"):
        shutil.move(str(f), moved / f.name)
    try:
        p = cache.plan(shared, family, src, "cpu")
        assert len({s.key for s in p.texts.values()}) == 2 and {s.caption for s in p.texts.values()} == {"same"}
    finally:
        for f in moved.glob("*.txt"):
            shutil.move(str(f), data / f.name)

    # Changing a source's bytes changes its image's text and latent keys, and only those.
    before = cache.plan(cfg, family, src, "cpu")
    source = Path(cfg.data.control_dir) / "03_table.png"
    original = source.read_bytes()
    try:
        from PIL import Image

        Image.open(SOURCES / "02_grass.png").save(source)
        after = cache.plan(cfg, family, src, "cpu")
    finally:
        source.write_bytes(original)
    key = lambda p, stem: {s.key for r, s in p.texts.items() if r[1].path.stem == stem}  # noqa: E731
    assert key(before, "03_table") != key(after, "03_table") and key(before, "01_sky") == key(after, "01_sky")
    lat = lambda p, stem: {s.key for s in p.latents if s.item.path.stem == stem}  # noqa: E731
    assert lat(before, "03_table") != lat(after, "03_table")


def test_the_loss_is_the_transformers_prediction_as_the_edit_pipeline_calls_it(plus, monkeypatch) -> None:
    cfg, family, src, the_plan, _ = plus
    samples = cache.load_samples(cfg, family, src, "cpu", the_plan)
    entry = next(s.variants[0] for s in samples if s.variants[0]["control_latents"].shape[0] == 2)
    trainable = load_tiny(family, src, cfg)
    encoders = family.load_text_encoders(src, torch.device("cpu"), torch.float32)
    pipe = pipeline("qwen_image_edit_plus", src, encoders)
    lat = entry["latents"][None]
    _, c, h, w = lat.shape
    x0 = pipe._pack_latents(lat, 1, c, h, w)
    # QwenImageEditPlusPipeline.prepare_latents: each source packed, concatenated after the noisy tokens.
    sources = torch.cat([pipe._pack_latents(s[None], 1, c, h, w) for s in entry["control_latents"]], dim=1)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(5))
    sigma = torch.tensor([0.6])
    e_mu = torch.exp(torch.tensor(trainable.shift_mu(x0.shape[1]), dtype=torch.float64))  # the target's tokens
    sig = (e_mu / (e_mu + (1 / sigma.double() - 1))).float()
    with torch.no_grad():
        pred = trainable.model(hidden_states=torch.cat([(1 - sig) * x0 + sig * noise, sources], dim=1), timestep=sig,
                               guidance=None, encoder_hidden_states_mask=None,
                               encoder_hidden_states=entry["prompt_embeds"][None],
                               img_shapes=[[(1, h // 2, w // 2)] * 3], return_dict=False)[0]
        reference = torch.nn.functional.mse_loss(pred[:, :x0.shape[1]], noise - x0)  # noise_pred[:, :latents.size(1)]

        class Fixed:
            def randn(self, shape, device=None, dtype=None):
                return noise.reshape(shape) if len(shape) > 1 else torch.logit(sigma)

        monkeypatch.setattr(flow_matching, "draws", lambda generator: Fixed())
        ours = trainable.loss({k: v[None] for k, v in entry.items()}, torch.Generator())
    # sigma in float64 here and in Python floats there: a few float32 ulps.
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=0)
    # The sources matter: without them the prediction differs.
    blank = {k: v[None] for k, v in entry.items()}
    blank["control_latents"] = torch.zeros_like(blank["control_latents"])
    with torch.no_grad():
        assert not torch.equal(trainable.loss(blank, torch.Generator()), ours)


def test_mirrored_pairs_and_the_other_edit_models_folder_are_refused(plus, tmp_path: Path) -> None:
    cfg, family, src, _, _ = plus
    with pytest.raises(ImgloraError) as exc:
        edit_config("qwen_image_edit_plus", tmp_path, ("01_sky",), None, "data.flip=true")
    assert "data.flip" in str(exc.value) and "mirror the files themselves" in str(exc.value)
    edit = registry.get("qwen_image_edit")
    with pytest.raises(ImgloraError, match='this model is a QwenImageEditPlusPipeline, not a QwenImageEditPipeline; '
                                          'set model.family = "qwen_image_edit_plus"'):
        edit.load_text_encoders(src, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("name", ["qwen_image_edit", "qwen_image_edit_plus"])
def test_the_comfyui_workflow_feeds_the_source_to_the_edit_text_encoder(name: str) -> None:
    family = registry.get(name)
    api = to_api(family.comfyui_nodes("mine.safetensors", "make it red", "", 7, "imglora/mine", False))
    by_type: dict[str, list] = {}
    for key, node in api.items():
        by_type.setdefault(node["class_type"], []).append((key, node["inputs"]))
    encode = "TextEncodeQwenImageEditPlus" if family.plus else "TextEncodeQwenImageEdit"
    image = "image1" if family.plus else "image"
    assert [n["prompt"] for _, n in by_type[encode]] == ["make it red", " "]
    scale_id, scale = by_type["ImageScaleToTotalPixels"][0]
    assert scale["megapixels"] == 1.0 and api[scale["image"][0]]["class_type"] == "LoadImage"
    for _, node in by_type[encode]:  # the scaled source and the VAE: its reference latent
        assert node[image] == [scale_id, 0] and api[node["vae"][0]]["class_type"] == "VAELoader"
    k = by_type["KSampler"][0][1]
    assert api[k["latent_image"][0]]["class_type"] == "VAEEncode" and k["cfg"] == 2.5 and k["steps"] == 20
    assert {api[k["positive"][0]]["class_type"], api[k["negative"][0]]["class_type"]} == {encode}
    unet = by_type["UNETLoader"][0][1]["unet_name"]
    assert unet == ("qwen_image_edit_2509_fp8_e4m3fn.safetensors" if family.plus else "qwen_image_edit_fp8_e4m3fn.safetensors")
    assert by_type["ModelSamplingAuraFlow"][0][1]["shift"] == 3.0
    for node in api.values():  # every link names a node
        for value in node["inputs"].values():
            if isinstance(value, list):
                assert value[0] in api


@pytest.mark.slow  # (40 s: the pipeline sees each source at 1024² area; CI runs it)
def test_a_run_trains_evaluates_from_the_sources_and_exports(tmp_path: Path) -> None:
    import numpy as np
    from PIL import Image
    from safetensors.torch import load_file

    from imglora.commands.evaluate import evaluate
    from imglora.commands.export import export as export_run
    from imglora.commands.train import train

    cfg = edit_config("qwen_image_edit_plus", tmp_path, ("01_sky", "03_table"), {"01_sky": 1},
                      "data.resolution=64", "train.max_steps=2", "train.warmup_steps=0", "train.log_every=1",
                      "train.checkpoint_every=0", "eval.sample_steps=2", "eval.strengths=[0, 1]",
                      f"eval.prompts=[{json.dumps((EDITS / '01_sky.txt').read_text().strip())}]")
    result = train(cfg, out=lambda s: None)
    trained = load_file(str(result.adapter))
    assert any(bool(v.abs().sum()) for k, v in trained.items() if "lora_B" in k)

    result_eval = evaluate(cfg.run_dir, out=lambda s: None)
    (step,) = result_eval.images
    folder = result_eval.sheets[step].parent
    family = registry.get("qwen_image_edit_plus")
    prompts = family.default_prompts(cfg)
    sources = [fit_to_bucket(open_image(Path(cfg.data.control_dir) / f), (64, 64)).image
               for f in ("01_sky.png", "01_sky_1.png")]
    assert np.array_equal(np.asarray(Image.open(folder / "p0_source.png")), np.asarray(sources[0]))
    # Strength 0 is QwenImageEditPlusPipeline with both sources, the prompt and " " as negative, real CFG.
    src = resolve_model(cfg.model.path, family)
    encoders = family.load_text_encoders(src, torch.device("cpu"), torch.float32)
    pipe = pipeline("qwen_image_edit_plus", src, encoders)
    pipe.set_progress_bar_config(disable=True)
    base = pipe(image=sources, prompt=prompts[0], negative_prompt=" ", true_cfg_scale=2.5, height=64, width=64,
                num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images[0]
    assert np.array_equal(np.asarray(Image.open(result_eval.images[step][0][0]).convert("RGB")), np.asarray(base))
    assert not np.array_equal(np.asarray(Image.open(result_eval.images[step][0][1]).convert("RGB")), np.asarray(base))

    exported = export_run(cfg.run_dir, out=tmp_path / "e.safetensors", dtype="fp32")
    tensors = load_file(str(exported.path))
    n_modules = len({k.rsplit(".lora_", 1)[0] for k in trained})
    assert all(k.startswith("diffusion_model.transformer_blocks.") for k in tensors)
    assert sum(k.endswith(".alpha") for k in tensors) == n_modules and len(tensors) == 3 * n_modules
    api = json.loads(exported.path.with_suffix(".workflow-api.json").read_text())
    assert "TextEncodeQwenImageEditPlus" in {n["class_type"] for n in api.values()}


@pytest.mark.slow  # (the default run keeps under 6 minutes; CI runs it)
def test_a_resumed_run_ends_exactly_as_an_uninterrupted_one(tmp_path: Path) -> None:
    """4 updates of Edit Plus with the preset's FP8 base and a swapped block, batch 2 (one target with
    two sources, one with one: captions of other lengths padded and masked), a checkpoint every 2;
    resumed from step 2, the same losses and adapter bit for bit."""
    from imglora.commands.train import train

    cfg = edit_config("qwen_image_edit_plus", tmp_path / "a", ("01_sky", "02_grass", "03_table", "04_wall"),
                      {"02_grass": 1}, "memory.fp8=true", "memory.blocks_to_swap=1", "data.resolution=64",
                      "train.batch_size=2", "train.max_steps=4", "train.warmup_steps=0", "train.log_every=1",
                      "train.checkpoint_every=2")
    result = train(cfg, out=lambda s: None)
    assert len(assert_resumes_exactly(cfg, result, tmp_path / "b")) == 4

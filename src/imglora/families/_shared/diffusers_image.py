"""What the diffusers image families (SDXL, FLUX) do the same way.

Plain functions whose first argument is the family; a family class names them as its methods
(``vae_folders = diffusers_image.vae_folders``). That shares the code without a base class, so each
family file still shows every method it has.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...util import devices
from ...config.checks import bucket_checks
from ...util.owned import own_module
from ...errors import ImgloraError
from ...family import text_length, text_options

if TYPE_CHECKING:
    from ...memory.swap import SwapLayout
    from PIL import Image

    from ...config import Config
    from ...models.source import ModelSource

ADAPTER_FILE = "pytorch_lora_weights.safetensors"  # the name diffusers' load_lora_weights looks for


def _weights_of(src: "ModelSource", part: str) -> list[Path]:
    """The single file holding ``part``: its own, else the full checkpoint that holds every part."""
    for name in (part, "checkpoint"):
        if name in src.files:
            return [src.files[name]]
    return []


def vae_folders(family: Any, src: "ModelSource") -> list[Path]:
    """What the latents' cache identity hashes: the VAE's config folder and its weights."""
    return [src.root / "vae", *_weights_of(src, "vae")]


def text_folders(family: Any, src: "ModelSource") -> list[Path]:
    """What the text entries' identity hashes: encoders' configs, tokenizers, and weights."""
    parts = [src.root / n for n in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")]
    # In part order (a file holding both parts counted once): a key then says which file is which encoder.
    weights = dict.fromkeys(p for part in ("text_encoder", "text_encoder_2") for p in _weights_of(src, part))
    return parts + list(weights)


def load_vae(family: Any, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
    from diffusers import AutoencoderKL

    return own_module(AutoencoderKL.from_pretrained(src.root, subfolder="vae", torch_dtype=dtype)).to(device).eval()


def scaled_posterior(dist: Any, std: bool, scale: Callable[[torch.Tensor], torch.Tensor],
                     factor: float) -> dict[str, torch.Tensor]:
    """The VAE posterior of one image as a cache entry: ``scale(mean)`` as the latents the model
    sees, and with ``std`` the standard deviation in the same units (``factor`` times it: the
    family's scaling is affine), so that ``latents + latents_std * noise`` is ``scale`` of a
    posterior sample (cache.latents = "sample")."""
    out = {"latents": scale(dist.mean)[0].float().cpu()}
    if std:
        out["latents_std"] = (dist.std * factor)[0].float().cpu()
    return out


def prepare_data(family: Any, cfg: "Config", src: "ModelSource", device: torch.device) -> Any:
    from ...data.cache import prepare_images

    return prepare_images(cfg, family, src, device)


def data_version(family: Any, cfg: "Config") -> str:
    """The training images' content version, from a scan (no encoder, no model)."""
    from ...data.scan import data_version as version, scan, split_holdout

    return version(cfg, split_holdout(cfg, scan(cfg, family))[0].items)


def collate(family: Any, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    from ...data.batches import stack

    return stack(entries)


def check_config(family: Any, cfg: "Config", where: Callable[[str], str], problems: list[str]) -> None:
    for i, s in enumerate(cfg.data.all_sets):
        if not s.dir:
            key = f"data.sets[{i}].dir" if cfg.data.sets else "data.dir"
            problems.append(f"{where(key)}: missing required key for the {family.name} family (the folder of "
                            "training images)")
    if cfg.export.format not in family.export_formats:
        problems.append(f"{where('export.format')}: {cfg.export.format!r} is not a {family.name} export form; "
                        f"choose one of {', '.join(family.export_formats)}")
    bucket_checks(cfg.data, family.bucket_step, family.name, where, problems)


# -- adapters -------------------------------------------------------------------------------------


def save_adapter(family: Any, model: torch.nn.Module, peft_config: Any, folder: Path,
                 text_encoders: dict[str, tuple[torch.nn.Module, Any]] | None = None) -> Path:
    """Write ``folder/pytorch_lora_weights.safetensors`` as ``<Pipeline>.load_lora_weights`` reads it.

    Keys are ``<unet|transformer>.<module>.lora_A.weight`` (LoHa ``hada_*``, LoKr ``lokr_*``), and
    ``text_encoder[_2].<module>...`` for the text encoders trained with lora.text_encoder
    (``text_encoders``: component -> (encoder, its peft config)); each component's peft config
    (type, rank, alpha) goes into the header, so diffusers applies alpha / rank exactly, also when
    alpha differs from rank, and export reads the type back.
    """
    import diffusers

    from ...adapters.inject import adapter_state_dict

    def meta(config: Any) -> dict[str, Any]:
        return {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.to_dict().items()}

    layers = {f"{family.denoiser}_lora_layers": adapter_state_dict(model),
              f"{family.denoiser}_lora_adapter_metadata": meta(peft_config)}
    for part, (encoder, config) in (text_encoders or {}).items():
        layers |= {f"{part}_lora_layers": adapter_state_dict(encoder), f"{part}_lora_adapter_metadata": meta(config)}
    getattr(diffusers, family.pipeline).save_lora_weights(folder, **layers)
    return folder / ADAPTER_FILE


def read_adapter(family: Any, folder: Path, component: str | None = None) -> dict[str, torch.Tensor]:
    """The adapter state of one component (the denoiser by default; ``text_encoder``, ...) of a
    saved adapter, keyed without the component's prefix."""
    from ...util.owned import load_file

    prefix = f"{component or family.denoiser}."
    weights = load_file(Path(folder) / ADAPTER_FILE)
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def base_weights(family: Any, src: "ModelSource", names: list[str]) -> dict[str, torch.Tensor]:
    """``{"<component>.<module>": weight}`` in fp32, as ComfyUI holds the base weight it patches:
    read from the component's safetensors in a model folder, else from the single files
    (``family.file_base_weights``)."""
    from ...models.safefiles import open_file

    paths: dict[str, list[str]] = {}
    for name in names:
        component, path = name.split(".", 1)
        paths.setdefault(component, []).append(path)
    out: dict[str, torch.Tensor] = {}
    for component, wanted in paths.items():
        files = _weight_files(src.root / component)
        if not files:
            got = family.file_base_weights(src, component, wanted)
        else:
            got = {}
            for path in wanted:
                # a CLIP's file keeps the text_model. level that transformers 5 no longer has
                key = next((k for k in (f"{path}.weight", f"{clip_path(path)}.weight") if k in files), None)
                if key is None:
                    raise ImgloraError(f"{src.root / component}: no weight {path}.weight for the adapted module "
                                       f"{component}.{path}")
                with open_file(files[key]) as r:
                    got[path] = r.get(key, torch.float32)
        out.update({f"{component}.{path}": w for path, w in got.items()})
    return out


# lora.text_encoder on a CLIP text encoder: its attention and MLP projections, the layers ComfyUI maps
# (lora_te1_text_model_encoder_layers_N_self_attn_q_proj, ...); transformers 5 has no text_model. level.
CLIP_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
CLIP_SCOPE = r"(text_model\.)?encoder\.layers\.\d+\.(self_attn|mlp)\."


def clip_tokens(tokenizer: Any, caption: str, max_length: int) -> torch.Tensor:
    """A caption's CLIP tokens as the families' encode_text makes them (padded and cut to max_length)."""
    return tokenizer(caption, padding="max_length", max_length=max_length, truncation=True,
                     return_tensors="pt").input_ids[0]


def clip_path(path: str) -> str:
    """A CLIP text encoder's module path as the released files, kohya and ComfyUI name it
    (``text_model.encoder.layers.0...``): transformers 5 dropped the ``text_model.`` level."""
    return path if path.startswith("text_model.") else f"text_model.{path}"


def _weight_files(folder: Path) -> dict[str, Path]:
    """{key: file} of a diffusers / transformers component folder's safetensors (sharded or not)."""
    import json

    from ...models.safefiles import open_file

    for stem in ("diffusion_pytorch_model", "model"):
        index = folder / f"{stem}.safetensors.index.json"
        if index.is_file():
            return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        single = folder / f"{stem}.safetensors"
        if single.is_file():
            with open_file(single) as r:
                return {k: single for k in r.keys}
    return {}


# -- the evaluation pass ---------------------------------------------------------------------------


def default_prompts(family: Any, cfg: "Config", n: int = 2) -> list[str]:
    """The captions of the first held-out images (else training images), each with and without the
    trigger word, so the rows show what the trigger adds and whether the adapter leaks into prompts
    without it. The trigger is data.trigger_word, or else the first comma-separated tag when every
    caption starts with the same one (kohya-style "sks toy, ..." captions)."""
    from ...data.scan import scan, split_holdout

    train, held = split_holdout(cfg, scan(cfg, family))
    sets = cfg.data.all_sets
    train_items = [i for i in train.items if not sets[i.set_index].regularization]
    captions = list(dict.fromkeys(i.caption for i in (*held.items, *train_items)))
    trigger = _trigger(cfg, train_items)
    prompts: list[str] = []
    for caption in captions[:n]:
        prompts.append(caption)
        without = _without_trigger(caption, trigger)
        if without and without != caption:
            prompts.append(without)
    return prompts or ([trigger] if trigger else ["a photo"])


def _trigger(cfg: "Config", train_items: list[Any]) -> str:
    return cfg.data.first_training_set().trigger_word.strip() or _shared_first_tag([i.caption for i in train_items])


def _without_trigger(caption: str, trigger: str) -> str:
    if not trigger:
        return caption
    return re.sub(rf"(?<!\w){re.escape(trigger)}(?!\w)\s*,?\s*", "", caption).strip(" ,")


def source_images(family: Any, cfg: "Config", prompts: list[str]) -> list["Image.Image"]:
    """An edit model's source image for each evaluation prompt, fitted (center crop) to the sample
    size: ``eval.control_images`` (one for every prompt, or one per prompt), else the source of the
    training or held-out image whose caption the prompt is (with or without the trigger word, as
    default_prompts makes them)."""
    return [images[0] for images in source_image_sets(family, cfg, prompts)]


def source_image_sets(family: Any, cfg: "Config", prompts: list[str]) -> list[list["Image.Image"]]:
    """As :func:`source_images`, every source of each prompt (a multi-image edit model's training
    image has several; ``eval.control_images`` gives one per prompt)."""
    from ...data.buckets import fit_to_bucket
    from ...data.images import BadImageError, open_image
    from ...data.scan import scan, split_holdout

    given = [Path(p) for p in cfg.eval.control_images]
    if given:
        if len(given) not in (1, len(prompts)):
            raise ImgloraError(f"eval.control_images has {len(given)} images for {len(prompts)} prompts; give one "
                               "source image for all prompts or one per prompt, in the prompts' order")
        paths = [[p] for p in (given * len(prompts) if len(given) == 1 else given)]
    else:
        train, held = split_holdout(cfg, scan(cfg, family))
        items = (*held.items, *train.items)
        trigger = _trigger(cfg, [i for i in train.items if not cfg.data.all_sets[i.set_index].regularization])
        by_caption: dict[str, list[Path]] = {}
        for item in items:
            for text in (item.caption, _without_trigger(item.caption, trigger)):
                by_caption.setdefault(text, list(item.controls))
        missing = [p for p in prompts if p not in by_caption]
        if missing:
            raise ImgloraError(f"{len(missing)} evaluation prompt(s) are no training image's caption, so they have no "
                               f"source image: {missing[0]!r}; an edit model edits an image: set eval.control_images "
                               "(one image for all prompts, or one per prompt)")
        paths = [by_caption[p] for p in prompts]
    size = sample_size(cfg, family)
    out = []
    for group in paths:
        images = []
        for path in group:
            try:
                images.append(fit_to_bucket(open_image(path), (size, size)).image)
            except (BadImageError, FileNotFoundError, OSError) as exc:
                raise ImgloraError(f"{path}: cannot read this source image for the evaluation ({exc}); give a png, "
                                   "jpg or webp file") from None
        out.append(images)
    return out


def _shared_first_tag(captions: list[str]) -> str:
    if len(captions) < 2 or not all("," in c for c in captions):
        return ""
    firsts = {c.split(",", 1)[0].strip() for c in captions}
    return firsts.pop() if len(firsts) == 1 else ""


def encode_prompts(family: Any, src: "ModelSource", prompts: list[str], cfg: "Config",
                   device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Prompt embeddings as the cache computes captions' (same encoders, precision and length),
    then the encoders are freed: they are never in memory together with the denoiser."""
    encoders = family.load_text_encoders(src, device, devices.dtype(devices.encoder_dtype_name(
        cfg.cache.encoder_dtype, device)))
    max_len = text_length(family, cfg, src)
    out = [family.encode_text(encoders, p, max_len, **text_options(family, cfg)) for p in prompts]
    del encoders
    devices.free(device)
    return out


def encode_prompts_with_negative(family: Any, src: "ModelSource", prompts: list[str], cfg: "Config",
                                 device: torch.device, negative: str) -> list[dict[str, torch.Tensor]]:
    """Each prompt's embeddings with the negative prompt's beside them as ``negative_*`` (a family
    sampled with real classifier-free guidance needs both)."""
    encoded = encode_prompts(family, src, [*prompts, negative], cfg, device)
    other = {f"negative_{k}": v for k, v in encoded[-1].items()}
    return [{**e, **other} for e in encoded[:-1]]


def guided_sampler(family: Any, src: "ModelSource", denoiser: torch.nn.Module, cfg: "Config", device: torch.device,
                   dtype: torch.dtype, default_guidance: float,
                   prompt_kwargs: Callable[[dict[str, torch.Tensor], torch.dtype, float], dict[str, Any]],
                   pipeline: str | None = None, **components: Any) -> Callable[..., Any]:
    """A sampler over the family's pipeline for a model sampled with real classifier-free guidance
    (a negative prompt; Chroma, Qwen-Image): the pipeline around the trained denoiser without text
    encoders, and ``prompt_kwargs(embeds, dtype, guidance)`` giving the pipeline's prompt and
    guidance arguments from an encoded prompt (see encode_prompts_with_negative). ``components``: more
    of the pipeline's parts to leave out or replace (e.g. ``processor=None``); ``pipeline``: the
    pipeline class where the family's models use more than one (default ``family.pipeline``)."""
    import diffusers

    diffusers.utils.logging.disable_progress_bar()
    import inspect

    cls = getattr(diffusers, pipeline or family.pipeline)
    takes = inspect.signature(cls.__init__).parameters
    none = {name: None for name in ("text_encoder", "tokenizer") if name in takes}  # (Qwen-Image 2.1's has no tokenizer)
    pipe = cls.from_pretrained(src.root, vae=family.load_vae(src, device, dtype), transformer=denoiser,
                               **{**none, **components})
    pipe.set_progress_bar_config(disable=True)
    size = sample_size(cfg, family)
    guidance = cfg.eval.guidance_scale or default_guidance
    steps = cfg.eval.sample_steps

    @torch.no_grad()
    def sample(embeds: dict[str, torch.Tensor], seed: int) -> "Image.Image":
        # A CPU generator: the same image on any device for the same seed (diffusers draws there).
        return pipe(**prompt_kwargs(embeds, denoiser.dtype, guidance), height=size, width=size,
                    num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed)).images[0]

    sample.settings = {"size": size, "steps": steps, "guidance": guidance}  # type: ignore[attr-defined]
    return sample


def sample_size(cfg: "Config", family: Any) -> int:
    """The square side of evaluation images: the (first) training set's resolution, a multiple of the
    family's bucket step."""
    step = family.bucket_step
    return max(step, cfg.data.first_training_set().resolution // step * step)


def diffusers_sampler(family: Any, src: "ModelSource", model: torch.nn.Module, cfg: "Config", device: torch.device,
                      dtype: torch.dtype, default_guidance: float,
                      scheduler_overrides: dict[str, Any] | None = None,
                      source_kwargs: Callable[["Image.Image"], dict[str, Any]] | None = None) -> Callable[..., Any]:
    """A sampler over the family's diffusers pipeline built around the trained (LoRA-injected)
    denoiser, without text encoders: prompts arrive as embeddings (see encode_prompts). An edit
    model's prompt carries its source image (``control_image``); ``source_kwargs`` turns it into
    the pipeline's arguments."""
    import diffusers

    diffusers.utils.logging.disable_progress_bar()  # imglora prints its own progress
    vae = family.load_vae(src, device, dtype)
    none = {name: None for name in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")}
    pipe = getattr(diffusers, family.pipeline).from_pretrained(src.root, vae=vae, **none,
                                                               **{family.denoiser: model})
    pipe.set_progress_bar_config(disable=True)
    if scheduler_overrides:
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, **scheduler_overrides)
    size = sample_size(cfg, family)
    guidance = cfg.eval.guidance_scale or default_guidance
    steps = cfg.eval.sample_steps

    @torch.no_grad()
    def sample(embeds: dict[str, torch.Tensor], seed: int) -> "Image.Image":
        kwargs = {k: embeds[k][None].to(device, model.dtype) for k in ("prompt_embeds", "pooled_prompt_embeds")}
        if source_kwargs is not None:
            kwargs |= source_kwargs(embeds["control_image"])
        # A CPU generator: the same image on any device for the same seed (diffusers draws there).
        return pipe(**kwargs, height=size, width=size, num_inference_steps=steps, guidance_scale=guidance,
                    generator=torch.Generator("cpu").manual_seed(seed)).images[0]

    settings: dict[str, Any] = {"size": size, "steps": steps, "guidance": guidance}
    if "timestep_spacing" in pipe.scheduler.config:  # a discrete-time schedule (SDXL's): where sampling starts
        pipe.scheduler.set_timesteps(steps)  # (the pipeline sets them again on each call)
        settings |= {"timestep_spacing": pipe.scheduler.config.timestep_spacing,
                     "first_timestep": float(pipe.scheduler.timesteps[0])}
    sample.settings = settings  # type: ignore[attr-defined]
    return sample


# Device types on which full-size benchmark models are made part by part on the device itself
# (tests add "cpu" to run that path without a GPU).
BUILD_ON_DEVICE = {"cuda"}


def trainable_members(module: Any) -> tuple[Callable[..., Any], ...]:
    """``load_trainable``, ``full_trainable``, ``meta_trainable`` and ``synthetic_batch`` for a family
    class whose ``model.py`` (``module``) has the streamed families' shape:
    ``load_trainable(src, cfg, device, dtype, layout, quantize_exclude)``,
    ``full_trainable(cfg, dtype, layout, device, family)``, ``meta_trainable(root, cfg, dtype)`` and
    ``synthetic_batch(trainable, resolution, cfg, device)``. A family assigns them in its class body,
    as it borrows ``prepare_data``."""

    def load_trainable(self: Any, src: "ModelSource", cfg: "Config", device: torch.device, dtype: torch.dtype,
                       swap: "SwapLayout") -> Any:
        return module.load_trainable(src, cfg, device, dtype, swap, self.quantize_exclude)

    def full_trainable(self: Any, cfg: "Config", dtype: torch.dtype, swap: "SwapLayout",
                       device: torch.device | None = None) -> Any:
        return module.full_trainable(cfg, dtype, swap, device, self)

    def meta_trainable(self: Any, src: "ModelSource | None", cfg: "Config", dtype: torch.dtype) -> Any:
        return module.meta_trainable(src.root if src is not None else None, cfg, dtype)

    def synthetic_batch(self: Any, trainable: Any, resolution: int, cfg: "Config",
                        device: torch.device) -> dict[str, torch.Tensor]:
        return module.synthetic_batch(trainable, resolution, cfg, device)

    return load_trainable, full_trainable, meta_trainable, synthetic_batch


def builds_on_device(device: torch.device | None) -> bool:
    """Whether ``full_trainable`` makes the model on ``device`` part by part (CUDA) rather than whole
    on the host."""
    return device is not None and device.type in BUILD_ON_DEVICE


def random_on_device(family: Any, model: torch.nn.Module, cfg: "Config", dtype: torch.dtype, device: torch.device,
                     parts: list[str], layout: "SwapLayout") -> tuple[torch.nn.Module, dict[str, Any]]:
    """A full-size architecture built on the meta device, given random weights on ``device`` part by
    part (``parts``: module names, the blocks), each part made ready as it is made, as a streamed
    single-file load does: quantized to fp8 there with ``memory.fp8`` (the family's
    ``quantize_exclude``, matched on full module names), then moved to the host if block swapping
    will keep it there (the blocks ``layout`` names: the command's swap layout, which
    :func:`imglora.memory.wrap.apply_memory` swaps). The device never holds the whole model in ``dtype``, and the host never
    builds it (a 12B FLUX.1 on the CPU takes minutes). What is left outside the parts (embedders,
    final layers) stays on ``device`` for :func:`imglora.memory.wrap.apply_memory` to finish.
    Returns the model and what was done, for the benchmark's record."""
    from ...memory.fp8 import quantize_fp8, to_device
    from ...models.tiny import random_init_parts

    layout.check(model)
    swapped = layout.modules()
    unknown = swapped - set(parts)
    if unknown:  # a family's parts must cover its swappable blocks, or they would stay on the device
        raise RuntimeError(f"swapped blocks outside the parts built: {sorted(unknown)[:4]}")
    fp8 = bool(cfg.memory.fp8)

    def ready(name: str, part: torch.nn.Module) -> None:
        if fp8:
            quantize_fp8(part, family.quantize_exclude, prefix=f"{name}.")
        if name in swapped:
            to_device(part, "cpu")

    model = random_init_parts(model, dtype, device, parts, ready)
    return model, {"built_on": str(device), "parts": len(parts), "quantized_as_built": fp8,
                   "left_on_host": len(swapped)}


def meta_text_encoders(family: Any, root: "Path | None", shipped: Path, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """lora.text_encoder: the encoders it trains (``family.text_encoder_parts``), made from their
    configs in ``root`` (else the ``shipped`` ones) on the meta device, frozen: for imglora plan."""
    import transformers

    encoders = {}
    for part in family.text_encoder_parts:
        folder = next(f / part for f in (root, shipped) if f is not None and (f / part / "config.json").is_file())
        config = transformers.AutoConfig.from_pretrained(str(folder))  # a local folder: no network
        with torch.device("meta"):
            encoders[part] = getattr(transformers, config.architectures[0])(config).to(dtype).requires_grad_(False)
    return encoders

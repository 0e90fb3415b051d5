"""Qwen-Image-Edit (Qwen/Qwen-Image-Edit) and Qwen-Image-Edit Plus (Qwen/Qwen-Image-Edit-2509 and
-2511): Qwen-Image's transformer, VAE, text encoder, cache, swap, fp8, plan and export, trained on
edit pairs (``control_dir``) as ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline`` run them.

What differs from Qwen-Image is here: Qwen2.5-VL reads each caption with its source image(s), so a
text entry is one image's and its sources key it (``text_reads_sources``; ``model``), the loss
appends the sources' latent tokens (``model``), evaluation samples from each prompt's source, the
ComfyUI workflow feeds the source through ``TextEncodeQwenImageEdit(Plus)`` (``comfyui``), the
shipped configs add the Edit pipelines' model_index.json and image processor (``configs``).
ComfyUI loads an Edit LoRA with Qwen-Image's key map (the same transformer), so export is
Qwen-Image's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...errors import ModelSourceError
from .._shared import diffusers_image as common
from ..qwen_image import QwenImageFamily
from ..qwen_image import keys as qwen_keys
from ..qwen_image import singlefile as qwen_files
from ..qwen_image import tiny as qwen_tiny
from . import comfyui, model
from .config import QwenImageEditConfig, QwenImageEditPlusConfig

if TYPE_CHECKING:
    from ...models.source import ModelSource

CONFIGS = Path(__file__).parent / "configs"


class QwenImageEditFamily(QwenImageFamily):
    name = "qwen_image_edit"
    section = QwenImageEditConfig
    pipeline = "QwenImageEditPipeline"
    control_images = 1  # EditPairs: one source image per target
    text_reads_sources = True  # Qwen2.5-VL reads the source with the caption: per-image text entries
    plus = False
    vision_area = model.EDIT_AREA
    configs = CONFIGS / "qwen-image-edit"
    architecture = "Qwen-Image-Edit/lora"

    def make_trainable(self, transformer: Any, settings: Any, train: Any, mu: Any) -> Any:
        variant = "qwen-image-edit-plus" if self.plus else "qwen-image-edit"
        return model.QwenImageEditTrainable(transformer, settings, train, mu, variant)

    def check_config(self, cfg: Any, where: Callable[[str], str], problems: list[str]) -> None:
        super().check_config(cfg, where, problems)
        for i, s in enumerate(cfg.data.all_sets):
            if s.flip:
                key = f"data.sets[{i}].flip" if cfg.data.sets else "data.flip"
                problems.append(f"{where(key)}: {self.name}'s text encoder reads the source image with the caption, so "
                                "a mirrored pair would need text entries of its own; set it to false (mirror the "
                                "files themselves, target and source, to train on both)")

    def build_tiny(self, dest: Path, seed: int) -> None:
        qwen_tiny.build(dest, seed, pipeline=self.pipeline, processor=self.configs / "processor",
                        words=model.TEMPLATE_WORDS)

    def resolve_files(self, model_cfg: Any, find: Any) -> "ModelSource":
        return qwen_files.resolve_files(model_cfg, find, overlay=self.configs)

    # -- cache ------------------------------------------------------------------------------
    def text_folders(self, src: "ModelSource") -> list[Path]:
        return [*super().text_folders(src), src.root / "processor"]

    def load_text_encoders(self, src: "ModelSource", device: torch.device, dtype: torch.dtype) -> Any:
        self._check_pipeline(src)
        tokenizer, encoder = super().load_text_encoders(src, device, dtype)
        folder = src.root / "processor" if (src.root / "processor").is_dir() else self.configs / "processor"
        return model.load_processor(folder, tokenizer), encoder

    @torch.no_grad()
    def encode_text(self, encoders: Any, caption: str, max_length: int,
                    sources: list[Any] | None = None) -> dict[str, torch.Tensor]:
        processor, encoder = encoders
        if not sources:
            raise ModelSourceError(f"{self.name} encodes a caption with its source image(s); none was given for "
                                   f"{caption!r}")
        views = [model.vision_view(image, self.vision_area) for image in sources[:self.control_images]]
        embeds = model.encode_caption(processor, encoder, caption, views, self.plus, max_length)
        return {"prompt_embeds": embeds.float().cpu()}

    def count_tokens(self, encoders: Any, caption: str, max_length: int) -> dict[str, tuple[int, int]]:
        return {"Qwen2.5-VL": (model.cut_caption(encoders[0].tokenizer, caption, max_length)[1], max_length)}

    def _check_pipeline(self, src: "ModelSource") -> None:
        """A diffusers folder of the other Edit model (or of Qwen-Image) is refused: its text template
        and sources differ."""
        index = src.root / "model_index.json"
        named = json.loads(index.read_text()).get("_class_name") if index.is_file() else None
        if named and named != self.pipeline:
            other = {"QwenImageEditPipeline": "qwen_image_edit", "QwenImageEditPlusPipeline": "qwen_image_edit_plus",
                     "QwenImagePipeline": "qwen_image"}.get(named)
            raise ModelSourceError(f"{src.root}: this model is a {named}, not a {self.pipeline}"
                                   + (f"; set model.family = \"{other}\"" if other else ""))

    # -- training ---------------------------------------------------------------------------
    def synthetic_batch(self, trainable: Any, resolution: int, cfg: Any, device: torch.device) -> dict[str, torch.Tensor]:
        # One source (Edit Plus takes up to three; each more adds the target's token count again).
        return model.synthetic_batch(trainable, resolution, cfg, device, 1, model.vision_tokens(self.vision_area))

    # -- evaluation -------------------------------------------------------------------------
    def encode_prompts(self, src: "ModelSource", prompts: list[str], cfg: Any, device: torch.device) -> list[Any]:
        """Each prompt with its source image(s), and the negative prompt with the same sources (the
        pipelines encode both with the image)."""
        from ...util.devices import dtype as dtype_of, encoder_dtype_name, free
        from ...family import text_length

        sets = common.source_image_sets(self, cfg, prompts)  # before any encoder loads: errors come first
        encoders = self.load_text_encoders(src, device, dtype_of(encoder_dtype_name(cfg.cache.encoder_dtype, device)))
        max_len = text_length(self, cfg, src)
        out = []
        for prompt, images in zip(prompts, sets):
            images = images[:self.control_images]
            e = self.encode_text(encoders, prompt, max_len, sources=images)
            negative = self.encode_text(encoders, comfyui.NEGATIVE, max_len, sources=images)
            out.append({**e, **{f"negative_{k}": v for k, v in negative.items()}, "control_image": images[0],
                        "control_images": images})
        del encoders
        free(device)
        return out

    def load_sampler(self, src: "ModelSource", denoiser: torch.nn.Module, cfg: Any, device: torch.device,
                     dtype: torch.dtype) -> Callable[..., Any]:
        plus = self.plus

        def prompt(e: dict[str, Any], t: torch.dtype, guidance: float) -> dict[str, Any]:
            ones = {k: torch.ones(1, e[k].shape[0], dtype=torch.long, device=device)
                    for k in ("prompt_embeds", "negative_prompt_embeds")}
            return {"image": list(e["control_images"]) if plus else e["control_image"],
                    "prompt_embeds": e["prompt_embeds"][None].to(device, t), "prompt_embeds_mask": ones["prompt_embeds"],
                    "negative_prompt_embeds": e["negative_prompt_embeds"][None].to(device, t),
                    "negative_prompt_embeds_mask": ones["negative_prompt_embeds"], "true_cfg_scale": guidance}

        return common.guided_sampler(self, src, denoiser, cfg, device, dtype, comfyui.CFG, prompt, processor=None)

    # -- export -------------------------------------------------------------------------------
    def export_metadata(self, cfg: Any, record: dict[str, Any]) -> dict[str, Any]:
        return {**qwen_keys.metadata(cfg, record), "modelspec.architecture": self.architecture}

    def comfyui_nodes(self, lora_name: str, prompt: str, negative: str, seed: int, prefix: str,
                      with_clip: bool, model: Any = None) -> list[Any]:
        return comfyui.nodes(lora_name, prompt, negative, seed, prefix, plus=self.plus, model=model)


class QwenImageEditPlusFamily(QwenImageEditFamily):
    """Qwen-Image-Edit-2509 / -2511: up to three sources per target (``<stem>``, ``<stem>_1``,
    ``<stem>_2`` in control_dir), each read by Qwen2.5-VL at about 384² after ``Picture i:``."""

    name = "qwen_image_edit_plus"
    section = QwenImageEditPlusConfig
    pipeline = "QwenImageEditPlusPipeline"
    control_images = model.PLUS_SOURCES
    plus = True
    vision_area = model.PLUS_AREA
    configs = CONFIGS / "qwen-image-edit-2509"
    architecture = "Qwen-Image-Edit-2509/lora"

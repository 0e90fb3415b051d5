"""What the diffusers image families (SDXL, FLUX) do the same way.

Plain functions whose first argument is the family; a family class names them as its methods
(``vae_folders = common.vae_folders``). That shares the code without a base class, so each family
file still shows every method it has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def vae_folders(family: Any, model_dir: Path) -> list[Path]:
    return [model_dir / "vae"]


def text_folders(family: Any, model_dir: Path) -> list[Path]:
    return [model_dir / n for n in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")]


def load_vae(family: Any, model_dir: Path, device: torch.device, dtype: torch.dtype) -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(model_dir, subfolder="vae", torch_dtype=dtype).to(device).eval()


def prepare_data(family: Any, cfg: Any, model_dir: Path, device: torch.device) -> Any:
    from ..data.cache import prepare_images

    return prepare_images(cfg, family, model_dir, device)


def data_version(family: Any, cfg: Any) -> str:
    """The training images' content version, from a scan (no encoder, no model)."""
    from ..data.cache import scan, split_holdout
    from ..data.dataset import dataset_version

    return dataset_version(split_holdout(cfg, scan(cfg, family))[0].items)


def collate(family: Any, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    from ..data.batches import stack

    return stack(entries)


def save_adapter(family: Any, model: Any, peft_config: Any, folder: Path) -> Path:
    from ..lora import save_for_diffusers

    return save_for_diffusers(family, model, peft_config, folder)


def read_adapter(family: Any, folder: Path) -> dict[str, torch.Tensor]:
    from ..lora import read_diffusers_adapter

    return read_diffusers_adapter(family, folder)


def default_prompts(family: Any, cfg: Any) -> list[str]:
    from ..evaluate import caption_prompts

    return caption_prompts(cfg, family)


def encode_prompts(family: Any, model_dir: Path, prompts: list[str], cfg: Any, device: torch.device) -> list[Any]:
    from ..evaluate import encode_with_text_encoders

    return encode_with_text_encoders(family, model_dir, prompts, cfg, device)


def random_init(model: Any, dtype: torch.dtype) -> Any:
    """Materialise a model built on the meta device with small random weights (norms at one)."""
    model = model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    return model

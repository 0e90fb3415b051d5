"""The registry: the only place that names the model families.

A family is one folder here that holds everything about it (loading, cache encoding, the loss,
sampling, LoRA targets, fp8 exclusions, swappable blocks, export key forms, its ComfyUI workflow,
its preset section, its tiny model). Adding a family = a new folder + one line in ``FAMILIES``.

Commands reach families only through ``registry``; the core never imports this package. The
registry is also the config loader's family catalog (``config.load(path, overrides, registry)``).
"""

from __future__ import annotations

from typing import Any, Callable

from .. import adapters
from ..adapters import blocks as lora_blocks
from ..family import CacheEncoder, EditPairs, Family, Swappable, TextEncoderTraining, option, supports
from .chroma import ChromaFamily
from .flux import FluxFamily
from .flux2 import Flux2Family
from .flux_kontext import FluxKontextFamily
from .krea2 import Krea2Family
from .llm import LlmFamily
from .qwen_image import QwenImageFamily
from .qwen_image21 import QwenImage21Family
from .qwen_image_edit import QwenImageEditFamily, QwenImageEditPlusFamily
from .sdxl import SdxlFamily
from .z_image import ZImageFamily

FAMILIES: dict[str, type] = {"sdxl": SdxlFamily, "flux": FluxFamily, "flux_kontext": FluxKontextFamily,
                             "chroma": ChromaFamily, "qwen_image": QwenImageFamily,
                             "qwen_image_edit": QwenImageEditFamily, "qwen_image_edit_plus": QwenImageEditPlusFamily,
                             "z_image": ZImageFamily, "flux2": Flux2Family,
                             "krea2": Krea2Family, "qwen_image21": QwenImage21Family, "llm": LlmFamily}


class Registry:
    """The installed families: by name, by capability, and as the config loader's catalog."""

    def names(self) -> tuple[str, ...]:
        return tuple(FAMILIES)

    def get(self, name: str) -> Family:
        """A fresh instance of family ``name`` (a family may hold per-run state, e.g. a padding id)."""
        if name not in FAMILIES:
            raise KeyError(f"no family {name!r}; known: {', '.join(FAMILIES)}")
        return FAMILIES[name]()

    def supporting(self, capability: type) -> list[str]:
        """Names of the families that implement ``capability`` (a protocol of ``imglora.family``)."""
        return [name for name in FAMILIES if supports(FAMILIES[name](), capability)]

    # -- the config loader's catalog -----------------------------------------------------------
    def section(self, name: str) -> type | None:
        return FAMILIES[name].section if name in FAMILIES else None

    def check(self, cfg: Any, where: Callable[[str], str], problems: list[str]) -> None:
        """Cross-field checks that depend on the family: what it supports, then its own checks."""
        family = self.get(cfg.model.family)
        name = family.name
        for key, n in (("memory.blocks_to_swap", cfg.memory.blocks_to_swap), ("eval.blocks_to_swap",
                                                                            cfg.eval.blocks_to_swap)):
            if n > 0 and not supports(family, Swappable):
                problems.append(f"{where(key)}: block swapping is implemented for {_the(self.supporting(Swappable))} "
                                f"only; set it to 0 for {name}")
        q = cfg.memory.quantization
        if q != "none" and (q not in family.quantizations if q != "auto" else not family.quantizations):
            able = [n for n in FAMILIES if FAMILIES[n].quantizations]
            problems.append(f"{where('memory.quantization')}: 4-bit quantization is for {_the(able)}; the {name} "
                            "family uses memory.fp8")
        if cfg.lora.text_encoder and not supports(family, TextEncoderTraining):
            problems.append(f"{where('lora.text_encoder')}: text-encoder training is implemented for "
                            f"{_the(self.supporting(TextEncoderTraining))}; set it to false for {name}")
        for i, s in enumerate(cfg.data.all_sets):
            key = f"data.sets[{i}].control_dir" if cfg.data.sets else "data.control_dir"
            if s.control_dir and not supports(family, EditPairs):
                problems.append(f"{where(key)}: source images are for the edit-model families "
                                f"({', '.join(self.supporting(EditPairs))}); the {name} family trains on images "
                                "alone: remove it")
            elif not s.control_dir and supports(family, EditPairs):
                problems.append(f"{where(key)}: missing required key for the {name} family (an edit model): the "
                                "folder of source images, one per training image with its file name")
        for key in ("dop_weight", "blank_preservation_weight"):
            if getattr(cfg.train, key) and not supports(family, CacheEncoder):
                problems.append(f"{where(f'train.{key}')}: output preservation is for the image families "
                                f"({', '.join(self.supporting(CacheEncoder))}); set it to 0 for {name}")
        if cfg.eval.control_images and not supports(family, EditPairs):
            problems.append(f"{where('eval.control_images')}: source images are for the edit-model families "
                            f"({', '.join(self.supporting(EditPairs))}); remove it for {name}")
        if cfg.train.text_encoder_lr and not cfg.lora.text_encoder:
            problems.append(f"{where('train.text_encoder_lr')}: applies with lora.text_encoder = true only")
        if cfg.lora.type not in family.adapter_types:
            problems.append(f"{where('lora.type')}: the {name} family trains {', '.join(family.adapter_types)} "
                            f"adapters, not {cfg.lora.type}")
        if cfg.memory.compile != "none" and not option(family, "compile_blocks"):
            able = [n for n in FAMILIES if option(FAMILIES[n], "compile_blocks")]
            problems.append(f"{where('memory.compile')}: compiled blocks are implemented for {_the(able)}; set it "
                            f"to \"none\" for {name}")
        problems.extend(adapters.config_problems(cfg.lora, where))
        lora_blocks.check(cfg, family, where, problems)
        family.check_config(cfg, where, problems)

    def meaningless_lora_keys(self, lo: Any) -> dict[str, tuple[Any, str]]:
        return adapters.meaningless_keys(lo)


registry = Registry()


def _the(names: list[str]) -> str:
    """"the flux family", "the flux and flux_kontext families"."""
    if len(names) == 1:
        return f"the {names[0]} family"
    return f"the {', '.join(names[:-1])} and {names[-1]} families"


def get_family(name: str) -> Family:
    return registry.get(name)

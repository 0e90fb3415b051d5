"""What the tests of the families made from the template share: sample images copied for a run, the
cached entries of a tiny preset, draws fixed to given noise and σ, a pipeline whose tensors are its
own, one short run per adapter type, and one run of 4 updates that resumes and evaluates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from imglora.commands.common import load_config
from imglora.commands.train import train
from imglora.data import cache
from imglora.families import registry
from imglora.models.resolve import resolve_model
from imglora.util.owned import own_module

q = lambda p: json.dumps(str(p))  # noqa: E731
# The adapter types' settings for two-update runs: OFT in blocks of its rank, LoKr with factor 4.
TYPE_SETTINGS = {"oft": ["lora.rank=4", "lora.alpha=0"], "lokr": ["lora.rank=4", "lora.factor=4"]}
OTHER_TYPES = ["lora.rank=4", "lora.alpha=6"]


def copy_images(dest: Path, sample_dataset: Path, stems=("01_sky", "03_table")) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for stem in stems:
        for f in sample_dataset.glob(f"{stem}.*"):
            shutil.copy(f, dest / f.name)
    return dest


def places(root: Path, data: Path) -> list[str]:
    return [f"data.dir={q(data)}", f"cache.dir={q(root / 'cache')}", f"run.output_dir={q(root / 'runs')}"]


def prepared(root: Path, sample_dataset: Path, preset: Path, family: str) -> tuple[Any, Any, Any, list[dict]]:
    """(config, family, model source, each image's cached entry) of ``preset`` without fp8 or swap."""
    cfg = load_config(preset, [*places(root, copy_images(root / "data", sample_dataset)), "memory.fp8=false",
                               "memory.blocks_to_swap=0", "data.buckets=false"])
    fam = registry.get(family)
    src = resolve_model(cfg.model.path, fam)
    the_plan, _ = cache.fill_cache(cfg, fam, src, "cpu", progress=False)
    samples = cache.load_samples(cfg, fam, src, "cpu", the_plan)
    return cfg, fam, src, [s.variants[0] for s in samples]


def owned(pipe: Any) -> Any:
    """A diffusers pipeline whose modules own their tensors (see imglora.util.owned), quiet."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            own_module(component)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class Fixed:
    """Draws that give ``noise`` for the noise and σ = ``sigma`` for the noise level (sigmoid(logit σ))."""

    def __init__(self, noise: torch.Tensor, sigma: torch.Tensor):
        self.noise, self.sigma = noise, sigma

    def randn(self, shape, device=None, dtype=None):
        return self.noise.reshape(shape) if len(shape) > 1 else torch.logit(self.sigma)


def typed_runs(tmp_path_factory: Any, sample_dataset: Path, preset: Path, tag: str,
               settings: dict[str, list[str]] = TYPE_SETTINGS) -> Callable[[str], tuple[Any, Path]]:
    """``get(kind)``: (config, run folder) of a two-update run with adapter type ``kind``, trained on
    first use."""
    made: dict[str, tuple] = {}

    def get(kind: str) -> tuple[Any, Path]:
        if kind not in made:
            root = tmp_path_factory.mktemp(f"{tag}-{kind}")
            data = copy_images(root / "data", sample_dataset, ("01_sky", "02_grass"))
            cfg = load_config(preset, [*places(root, data), "train.max_steps=2", "train.warmup_steps=0",
                                       "train.checkpoint_every=1", f'lora.type="{kind}"',
                                       *settings.get(kind, OTHER_TYPES)])
            train(cfg, out=lambda s: None)
            made[kind] = (cfg, cfg.run_dir)
        return made[kind]

    return get


def four_update_run(root: Path, sample_dataset: Path, preset: Path, *extra: str) -> tuple[Any, Any]:
    """(config, result) of 4 updates in batches of 2 at 64 px with the preset's memory settings,
    checkpoints at 2 and 4, evaluated at strengths 0 and 1 in 2 sampler steps."""
    data = copy_images(root / "data", sample_dataset, ("01_sky", "02_grass", "03_table", "04_wall"))
    cfg = load_config(preset, [*places(root, data), "data.buckets=false", "data.resolution=64", "train.batch_size=2",
                               "train.max_steps=4", "train.warmup_steps=0", "train.log_every=1",
                               "train.checkpoint_every=2", "eval.strengths=[0, 1]", "eval.sample_steps=2", *extra])
    return cfg, train(cfg, out=lambda s: None)

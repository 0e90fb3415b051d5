"""The contract every registered family keeps, checked on each one's tiny model through the
protocols the core uses (nothing here names a family): data, loss, gradients, adapter round trip,
tiny model, config section, and each optional capability it claims."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from imglora import config
from imglora.adapters import inject as lora
from imglora.training import step as loop
from imglora.commands.common import load_config
from imglora.data.samples import PreparedData
from imglora.family import (Benchable, CacheEncoder, EditPairs, Exportable, Family, Mergeable, Sampler,
                            Swappable, supports)
from imglora.families import registry
from imglora.models.resolve import resolve_model
from imglora.memory.wrap import resolve_swap
from loading import load_tiny, tiny_session

REPO = Path(__file__).resolve().parents[2]
# Families whose own test files check them in the default run keep this contract for CI (--slow): the
# default run stays under 6 minutes on 2 cores. (Qwen-Image-Edit is Edit Plus's twin but for its template.)
SLOW = {"flux_kontext", "chroma", "qwen_image_edit"}
NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in registry.names()]


def small_config(name: str, tmp_path: Path, sample_dataset: Path) -> config.Config:
    """The family's tiny preset on two sample images (families that read images) in tmp_path."""
    data = tmp_path / "data"
    data.mkdir()
    edits = supports(registry.get(name), EditPairs)  # an edit model: the sample edit pairs' targets and sources
    source = sample_dataset.parent / "edit_toy" if edits else sample_dataset
    extra = []
    for stem in ("01_sky", "03_table"):
        for f in source.glob(f"{stem}.*"):
            shutil.copy(f, data / f.name)
        if edits:
            (tmp_path / "sources").mkdir(exist_ok=True)
            shutil.copy(source.parent / "edit_toy_sources" / f"{stem}.png", tmp_path / "sources" / f"{stem}.png")
            extra = [f"data.control_dir={json.dumps(str(tmp_path / 'sources'))}"]
    return load_config(REPO / "presets" / f"tiny-{name.replace('_', '-')}.toml", [
        f"data.dir={json.dumps(str(data))}", f"cache.dir={json.dumps(str(tmp_path / 'cache'))}",
        f"run.output_dir={json.dumps(str(tmp_path / 'runs'))}", "train.max_steps=2", "train.warmup_steps=0", *extra])


@pytest.fixture(scope="module", params=NAMES)
def prepared(request, tmp_path_factory):
    """Prepared once per family (no test changes it): the data each test reads, cached once."""
    name = request.param
    family = registry.get(name)
    cfg = small_config(name, tmp_path_factory.mktemp(name), REPO / "sample_datasets" / "sks_toy")
    model_dir = resolve_model(cfg.model.path, family)
    data = family.prepare_data(cfg, model_dir, torch.device("cpu"))
    return family, cfg, model_dir, data


def test_is_a_family_with_a_section_a_tiny_model_and_a_data_version(prepared) -> None:
    family, cfg, model_dir, data = prepared
    assert supports(family, Family) and registry.get(family.name).name == family.name
    assert cfg.family is not None and type(cfg.family) is family.section  # its own [name] section
    assert (model_dir.root / family.model_marker).is_file()
    assert isinstance(data, PreparedData) and data.samples and len(data.version) == 64
    assert family.data_version(cfg) == data.version  # the same version without any model


def test_finite_loss_and_gradients_on_lora_only(prepared) -> None:
    family, cfg, model_dir, data = prepared
    trainable = load_tiny(family, model_dir, cfg)
    lora.inject(trainable.model, family, cfg.lora, seed=0)
    batch = family.collate([data.samples[0].variants[0]])
    loss = trainable.loss(batch, torch.Generator().manual_seed(0))
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    named = dict(trainable.model.named_parameters())
    assert all((p.grad is not None) == ("lora_" in n) for n, p in named.items())
    assert any(p.grad.abs().sum() > 0 for n, p in named.items() if "lora_B" in n)


def test_adapter_saves_and_reads_back_exactly(prepared, tmp_path: Path) -> None:
    family, cfg, model_dir, _ = prepared
    trainable = load_tiny(family, model_dir, cfg)
    peft_cfg = lora.inject(trainable.model, family, cfg.lora, seed=0)
    gen = torch.Generator().manual_seed(1)
    for n, p in trainable.model.named_parameters():
        if "lora_" in n:  # B starts at zero: a round trip of zeros would prove nothing
            p.data = torch.randn(p.shape, generator=gen)
    saved = {k: v for k, v in lora.adapter_state_dict(trainable.model).items() if "lora_" in k}
    main_file = family.save_adapter(trainable.model, peft_cfg, tmp_path / "adapter")
    assert main_file.is_file() and main_file.name == family.adapter_file
    read = family.read_adapter(tmp_path / "adapter")
    assert read.keys() == saved.keys() and all(torch.equal(read[k], saved[k]) for k in saved)


def test_each_claimed_capability_works(prepared) -> None:
    family, cfg, model_dir, data = prepared
    device = torch.device("cpu")
    if supports(family, CacheEncoder):
        assert family.bucket_step > 0 and family.text_max_length > 0
        assert all(p.is_dir() for p in family.vae_folders(model_dir) + family.text_folders(model_dir))
    if supports(family, Sampler):
        assert family.default_prompts(cfg)
    if supports(family, Swappable):
        counts = family.block_counts(model_dir)
        swap = resolve_swap(family, cfg, model_dir)
        trainable = family.load_trainable(model_dir, cfg, device, torch.float32, swap)
        assert counts == [len(getattr(trainable.model, n)) for n in family.swappable_blocks]
        none = family.with_blocks_to_swap(cfg, 0)
        assert none.memory.blocks_to_swap == 0 and family.swap_counts(counts, none) == [0] * len(counts)
    if supports(family, Benchable):
        trainable = load_tiny(family, model_dir, cfg, device, torch.float32)
        batch = family.synthetic_batch(trainable, 64, cfg, device)
        with torch.no_grad():
            assert torch.isfinite(trainable.loss(batch, torch.Generator().manual_seed(0)))
    if supports(family, Exportable):
        assert family.export_formats[0] == "default"
        assert family.comfyui_nodes("x.safetensors", "a photo", "", 0, "imglora/x", False)
    if supports(family, Mergeable):
        assert callable(family.merge)


def test_one_update_through_the_shared_step(prepared) -> None:
    family, cfg, model_dir, data = prepared
    accelerator = loop.accelerator_for(cfg)
    session, trainable = tiny_session(family, model_dir, cfg, total=2, accelerator=accelerator)
    before = {n: p.detach().clone() for n, p in session.model.named_parameters() if p.requires_grad}
    loss_sum = torch.zeros(())
    batch = family.collate([data.samples[0].variants[0]])
    loop.step(session, loop.simple_micros([batch], torch.Generator().manual_seed(0)), loss_sum)
    assert torch.isfinite(loss_sum) and loss_sum > 0 and session.stage == "done"
    after = dict(session.model.named_parameters())
    assert any(not torch.equal(after[n], v) for n, v in before.items())
    assert all(p.grad is None for p in session.params)  # zeroed for the next update


def test_the_direct_step_is_accelerates_step_bit_for_bit(prepared) -> None:
    """One process, no loss scaler: ``step`` clips and steps the optimizer itself (accelerate's
    wrappers add per-update checks and nothing else). The same update from the same state, on the
    same tensors, through both ways: the same gradient norm and weights, bit for bit (the same
    kernels on the same memory)."""
    import copy

    family, cfg, model_dir, data = prepared
    session, trainable = tiny_session(family, model_dir, cfg, total=4)
    assert session.direct and loop.steps_directly(session.accelerator)
    batch = family.collate([data.samples[0].variants[0]])
    loop.step(session, loop.simple_micros([batch], torch.Generator().manual_seed(0)), torch.zeros(()))  # some state
    start = [p.detach().clone() for p in session.params]
    opt_state = copy.deepcopy(session.optimizer.state_dict())
    sched_state = copy.deepcopy(session.scheduler.state_dict())
    results = []
    for direct in (True, False):
        with torch.no_grad():
            for p, v in zip(session.params, start):
                p.copy_(v)
        session.optimizer.load_state_dict(copy.deepcopy(opt_state))
        session.scheduler.load_state_dict(copy.deepcopy(sched_state))
        session.direct = direct
        torch.manual_seed(2)  # LoRA dropout (the LLM preset's) draws from the global RNG, as in the loop
        loop.step(session, loop.simple_micros([batch], torch.Generator().manual_seed(1)), torch.zeros(()))
        results.append((session.grad_norm.clone(), [p.detach().clone() for p in session.params],
                         session.scheduler.get_last_lr()))
    (norm_a, params_a, lr_a), (norm_b, params_b, lr_b) = results
    assert float(norm_a) > 0 and torch.equal(norm_a, norm_b) and lr_a == lr_b
    assert any(not torch.equal(a, s) for a, s in zip(params_a, start))  # the update moved the weights
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    assert all(p.grad is None for p in session.params)


def test_a_loss_scaler_keeps_accelerates_step() -> None:
    """fp16's loss scaler (and several processes) need accelerate's wrappers: unscaling before
    clipping, skipping an overflowed step."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    assert not loop.steps_directly(SimpleNamespace(num_processes=1, scaler=object(),
                                                   distributed_type=DistributedType.NO))
    assert not loop.steps_directly(SimpleNamespace(num_processes=2, scaler=None,
                                                   distributed_type=DistributedType.MULTI_CPU))
    assert loop.steps_directly(SimpleNamespace(num_processes=1, scaler=None, distributed_type=DistributedType.NO))

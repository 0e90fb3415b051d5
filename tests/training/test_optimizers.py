"""Optimizers by name: every one builds, steps, and continues bit for bit from its saved state; prodigy
and schedule-free resume a training run bit for bit; a missing package is one error naming the pip install."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file, save

from imglora.training import checkpoint, optimizers
from imglora.commands.common import load_config
from imglora.commands.train import train
from imglora.errors import ConfigError, ImgloraError
from imglora.families._shared.diffusers_image import ADAPTER_FILE

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "presets" / "tiny-sdxl.toml"

NAMES = {  # name -> (optimizer_args, the package it needs)
    "adamw": ({}, None), "adafactor": ({}, None), "SGD": ({"momentum": 0.9}, None),
    "torch.optim.RAdam": ({}, None), "prodigy": ({"d_coef": 2.0, "safeguard_warmup": True}, "prodigyopt"),
    "schedulefree_adamw": ({"warmup_steps": 2}, "schedulefree"), "adamw8bit": ({}, "bitsandbytes"),
    "paged_adamw8bit": ({}, "bitsandbytes"), "lion8bit": ({"betas": [0.9, 0.99]}, "bitsandbytes"),
}


def quiet(_: str) -> None:
    pass


def cfg_for(name: str, args: dict, *extra: str):
    return load_config(PRESET, [f'train.optimizer="{name}"', f"train.optimizer_args={toml_table(args)}", *extra])


def toml_table(args: dict) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v).lower() if isinstance(v, bool) else json.dumps(v)}"
                           for k, v in args.items()) + "}"


def needs(package: str | None) -> None:
    if package:
        pytest.importorskip(package)


def params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    # big enough for bitsandbytes' 8-bit state (>= 4096 values), a matrix for adafactor's factored one
    return [torch.nn.Parameter(torch.randn(64, 80, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]


def steps(opt: torch.optim.Optimizer, ps: list[torch.nn.Parameter], n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("name", list(NAMES))
def test_each_optimizer_continues_bit_for_bit_from_its_saved_state(name: str) -> None:
    """What a checkpoint keeps (tensors through safetensors, the rest through JSON) puts a fresh
    optimizer where the saved one was: two more steps give the same weights, bit for bit."""
    args, package = NAMES[name]
    needs(package)
    cfg = cfg_for(name, args, "train.learning_rate=0.01")
    a = params()
    opt_a = optimizers.make(cfg, a)
    steps(opt_a, a, 3, seed=1)
    tensors, rest = checkpoint.optimizer_to_tensors(opt_a.state_dict())
    state = checkpoint.optimizer_from_tensors(load(save(tensors)), json.loads(json.dumps(rest)))
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = optimizers.make(cfg, b)
    opt_b.load_state_dict(state)
    before = [p.detach().clone() for p in a]
    steps(opt_a, a, 2, seed=2)
    steps(opt_b, b, 2, seed=2)
    assert not torch.equal(a[0], before[0])  # it trains
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_arguments_reach_the_optimizer_and_override_the_adam_settings() -> None:
    pytest.importorskip("prodigyopt", reason="prodigyopt is optional: pip install -e \".[optim]\"")
    cfg = cfg_for("prodigy", {"d_coef": 2.0, "safeguard_warmup": True, "betas": [0.95, 0.99]},
                  "train.learning_rate=1.0", "train.weight_decay=0.02")
    group = optimizers.make(cfg, params()).param_groups[0]
    assert group["d_coef"] == 2.0 and group["safeguard_warmup"] is True and list(group["betas"]) == [0.95, 0.99]
    assert group["lr"] == 1.0 and group["weight_decay"] == 0.02 and group["eps"] == cfg.train.adam_eps
    sgd = optimizers.make(cfg_for("sgd", {"nesterov": True, "momentum": 0.5}), params()).param_groups[0]
    assert type(optimizers.make(cfg_for("sgd", {}), params())) is torch.optim.SGD
    assert sgd["nesterov"] and sgd["momentum"] == 0.5 and "betas" not in sgd  # no Adam settings for SGD


def test_config_errors_name_the_optimizer_problems_all_at_once() -> None:
    pytest.importorskip("prodigyopt", reason="prodigyopt is optional: pip install -e \".[optim]\"")
    with pytest.raises(ConfigError) as exc:
        load_config(PRESET, ['train.optimizer="prodigy"', "train.optimizer_args={d_coeff = 2, lr = 1}",
                             "train.warmup_steps=1000"])
    msg = str(exc.value)
    assert 'd_coeff: not an argument of prodigyopt.Prodigy (did you mean "d_coef"?)' in msg
    assert "lr: set train.learning_rate instead" in msg and "warmup steps exceed" in msg
    with pytest.raises(ConfigError, match=r"unknown optimizer 'adamw9bit' \(did you mean \"adamw8bit\"\?\)"):
        load_config(PRESET, ['train.optimizer="adamw9bit"'])
    with pytest.raises(ConfigError, match="train.optimizer_args: expected a table"):
        load_config(PRESET, ["train.optimizer_args=3"])
    with pytest.raises(ConfigError, match="schedule-free optimizer already averages"):
        load_config(PRESET, ['train.optimizer="schedulefree_adamw"', "train.ema=true"])


def test_a_missing_package_is_one_error_naming_the_pip_install(small_run, monkeypatch) -> None:
    import importlib.util

    from imglora.families import sdxl

    real = importlib.util.find_spec
    gone = {"prodigyopt", "wandb"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in gone else real(name, *a))

    def never(*a, **k):
        raise AssertionError("data or the model were touched before the dependency check")

    for name in ("prepare_data", "load_trainable"):
        monkeypatch.setattr(sdxl.SdxlFamily, name, never)
    cfg = load_config(PRESET, [*small_run(), 'train.optimizer="prodigy"', 'run.log_with=["wandb"]'])
    with pytest.raises(ImgloraError) as exc:
        train(cfg, out=quiet)
    assert str(exc.value) == ('train.optimizer = "prodigy" needs prodigyopt; run.log_with = ["wandb"] needs wandb: '
                              "`pip install prodigyopt wandb`")


# ---------------------------------------------------------------------------------------------
# Whole runs: prodigy and schedule-free resume bit for bit
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,args", [
    pytest.param("prodigy", "{d_coef = 1.5, safeguard_warmup = true, use_bias_correction = true}",
                 marks=pytest.mark.slow),  # (the default run stays under 6 minutes; CI runs it)
    pytest.param("schedulefree_adamw", "{warmup_steps = 1}", marks=pytest.mark.slow)])
def test_run_resumes_bit_for_bit(small_run, name, args) -> None:
    """With validation every update (schedule-free switches to its eval mode and back for it)."""
    needs(NAMES[name][1])
    lr = "1.0" if name == "prodigy" else "0.003"
    cfg = load_config(PRESET, [*small_run(), f'train.optimizer="{name}"', f"train.optimizer_args={args}",
                               f"train.learning_rate={lr}", "train.max_steps=4", "train.checkpoint_every=2",
                               "train.warmup_steps=0", "train.log_every=1", "eval.every=1", "eval.holdout=1"])
    train(cfg, out=quiet)
    run = cfg.run_dir
    final = load_file(str(run / "adapter" / ADAPTER_FILE))
    ckpt = checkpoint.load(checkpoint.step_dir(run, 2))
    if name == "schedulefree_adamw":  # the adapter: its averaged (eval) weights; beside it the stepped ones
        adapter = load_file(str(ckpt["adapter_dir"] / ADAPTER_FILE))
        stepped = ckpt["train_params"]
        assert sorted(v.numel() for v in stepped.values()) == sorted(v.numel() for v in adapter.values())
        assert not all(any(torch.equal(s, a) for a in adapter.values()) for s in stepped.values())
        assert all(g["train_mode"] for g in ckpt["optimizer_state"]["param_groups"])  # saved in train mode
    else:
        assert ckpt["train_params"] is None
        assert {"d", "d_numerator", "d_max"} <= set(ckpt["optimizer_state"]["param_groups"][0])  # its step size state
    shutil.rmtree(checkpoint.step_dir(run, 4))
    shutil.rmtree(run / "adapter")
    lines: list[str] = []
    train(cfg, resume=True, out=lines.append)
    assert any("resuming from" in x and "step-000002" in x for x in lines)
    again = load_file(str(run / "adapter" / ADAPTER_FILE))
    assert final.keys() == again.keys()
    assert all(torch.equal(final[k], again[k]) for k in final), f"{name}: resumed adapter differs"


# ---------------------------------------------------------------------------------------------
# A dotted path: only trusted modules are imported, and only an Optimizer subclass is ever called
# ---------------------------------------------------------------------------------------------


@pytest.fixture()
def own_module(tmp_path: Path, monkeypatch):
    """A module of the user's on sys.path that leaves a file behind when it is imported, and one when
    its function is called."""
    import sys

    (tmp_path / "my_optim.py").write_text(
        "import pathlib, torch\n"
        f"pathlib.Path({str(tmp_path / 'imported')!r}).touch()\n"
        "class Fancy(torch.optim.SGD):\n    pass\n"
        f"def not_an_optimizer(*a, **k):\n    pathlib.Path({str(tmp_path / 'called')!r}).touch()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_optim", None)


def test_a_module_outside_the_optimizer_packages_is_refused_before_it_is_imported(own_module) -> None:
    for name in ("my_optim.Fancy", "os.system", "this.s"):
        with pytest.raises(ConfigError) as exc:
            load_config(PRESET, [f'train.optimizer="{name}"'])
        module = name.split(".")[0]
        assert exc.value.problems == [
            f'--set train.optimizer: train.optimizer = "{name}": {module} is not one of the optimizer modules imglora '
            "imports on its own (torch, bitsandbytes, prodigyopt, schedulefree, transformers.optimization), and "
            "importing a module runs its code; for your own optimizer class, set train.optimizer_allow_any = true"]
    assert not (own_module / "imported").exists()
    # Not through make() either, with a configuration built without the checks.
    unchecked = load_config(PRESET).replace(train={"optimizer": "my_optim.Fancy"})
    with pytest.raises(ImgloraError, match="set train.optimizer_allow_any = true"):
        optimizers.make(unchecked, params())
    assert not (own_module / "imported").exists()


def test_with_the_opt_in_the_module_is_imported_and_must_give_an_optimizer_class(own_module) -> None:
    cfg = load_config(PRESET, ['train.optimizer="my_optim.Fancy"', "train.optimizer_allow_any=true"])
    assert (own_module / "imported").exists()
    opt = optimizers.make(cfg, params())
    assert type(opt).__name__ == "Fancy" and isinstance(opt, torch.optim.SGD)
    for name, what in (("my_optim.not_an_optimizer", "a function"), ("os.system", "a builtin_function_or_method")):
        with pytest.raises(ConfigError) as exc:
            load_config(PRESET, [f'train.optimizer="{name}"', "train.optimizer_allow_any=true"])
        assert exc.value.problems == [f'--set train.optimizer: train.optimizer = "{name}": {name} is {what}, not a '
                                      "torch.optim.Optimizer subclass; name an optimizer class"]
        unchecked = cfg.replace(train={"optimizer": name})
        with pytest.raises(ImgloraError, match="not a torch.optim.Optimizer subclass"):
            optimizers.make(unchecked, params())  # refused before it is called
    assert not (own_module / "called").exists()


def test_a_trusted_module_is_checked_for_an_optimizer_class_at_config_time() -> None:
    cases = {"torch.save": "torch.save is a function, not a torch.optim.Optimizer subclass",
             "torch.nn.Linear": "torch.nn.Linear is the class Linear, not a torch.optim.Optimizer subclass",
             "torch.optim.Nope": "torch.optim has no Nope", "torch.nope.Foo": "there is no module torch.nope"}
    for name, why in cases.items():
        with pytest.raises(ConfigError) as exc:
            load_config(PRESET, [f'train.optimizer="{name}"'])
        assert exc.value.problems == [f'--set train.optimizer: train.optimizer = "{name}": {why}' +
                                      ("; name an optimizer class" if "subclass" in why else "")]
    assert type(optimizers.make(load_config(PRESET, ['train.optimizer="torch.optim.RAdam"']), params())) \
        is torch.optim.RAdam

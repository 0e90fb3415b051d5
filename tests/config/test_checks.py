"""Config checks that used to wait for `train` or `export`, or never came: each problem is one line
naming its key, reported by `imglora config` as by `imglora train`, before anything is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from imglora.cli import main
from imglora.commands.common import load_config
from imglora.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SDXL = REPO / "presets" / "tiny-sdxl.toml"
FLUX = REPO / "presets" / "tiny-flux.toml"
DATASETS = REPO / "presets" / "tiny-datasets.toml"  # three [[data.sets]] tables


def problems(preset: Path, overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        load_config(preset, overrides)
    return exc.value.problems


def config_cli(preset: Path, *overrides: str):
    return CliRunner().invoke(main, ["config", str(preset), *[x for o in overrides for x in ("--set", o)]])


# -- --set data.sets[i] ---------------------------------------------------------------------------


def test_a_set_index_that_is_not_one_of_the_sets_says_which_indices_there_are() -> None:
    got = problems(DATASETS, ["data.sets[x].repeats=2", "data.sets[-1].repeats=2", "data.sets[3].repeats=2",
                              "data.sets[1]=4"])
    assert got == [
        "--set data.sets[x].repeats: sets[x]: the index must be an integer 0…2 (the preset has 3 [[data.sets]] "
        "tables; counted from 0)",
        "--set data.sets[-1].repeats: sets[-1]: the index must be an integer 0…2 (the preset has 3 [[data.sets]] "
        "tables; counted from 0)",
        "--set data.sets[3].repeats: there is no sets[3] (the preset has 3 [[data.sets]] tables; the index must be "
        "0…2)",
        "--set data.sets[1]: that is a whole table; set one of its keys, e.g. --set data.sets[1].repeats=2",
    ]
    assert load_config(DATASETS, ["data.sets[2].repeats=7"]).data.sets[2].repeats == 7
    assert problems(SDXL, ["data.sets[0].repeats=2"]) == [
        "--set data.sets[0].repeats: there is no sets[0] (the preset has 0 [[data.sets]] tables; add [[data.sets]] "
        "tables to the preset first)"]


# -- run.name and export.name: plain names ------------------------------------------------------


def test_run_name_and_export_name_must_be_plain_names(tmp_path: Path) -> None:
    preset = tmp_path / "p.toml"
    preset.write_text(f'extends = "{SDXL}"\n[export]\nname = "../../x"\n')
    got = problems(preset, ["run.name=../../escaped", f"run.output_dir={str(tmp_path / 'runs')!r}"])
    rule = 'use a plain file name without folders or any of <>:"/\\|?*'
    assert got == [
        f"--set run.name: '../../escaped' is not a plain name: {rule} (the run folder is run.output_dir/run.name; "
        "choose the parent folder with run.output_dir)",
        f"{preset}: export.name: '../../x' is not a plain name: {rule} (choose the folder with export.comfyui_dir "
        "or `imglora export --out`)",
    ]
    for bad in ('"a/b"', '".hidden"', '"a:b"', '"C:\\\\x"'):
        assert problems(SDXL, [f"run.name={bad}"])[0].startswith("--set run.name: ")
    cfg = load_config(SDXL, ['run.name="my run 2"', 'export.name="toy.safetensors"'])
    assert cfg.run_dir == Path("runs") / "my run 2" and cfg.export.name == "toy.safetensors"


def test_a_caption_extension_with_a_folder_part_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    """data.caption_ext is joined to every image's name: a folder part or a bare dot used to pass
    `imglora config` and then end `imglora train` in a ValueError from pathlib."""
    rule = ("is not a file extension: give letters, digits, '_' or '-' after a dot, such as \".txt\" or "
            "\".caption\" (no folder part, at most 32 characters)")
    assert problems(SDXL, ['data.caption_ext="/../../etc/hostname"']) == [
        f"--set data.caption_ext: '/../../etc/hostname' {rule}"]
    for bad in ("''", '"."', '"../x"', '".a/b"', '".txt\\x"', '". txt"', '"' + "x" * 40 + '"'):
        got = problems(SDXL, [f"data.caption_ext={bad}"])
        assert len(got) == 1 and got[0].startswith("--set data.caption_ext: ") and rule in got[0], (bad, got)
    got = problems(DATASETS, ['data.sets[2].caption_ext="a/b"'])
    assert got == [f"--set data.sets[2].caption_ext: 'a/b' {rule}"]
    for good in ('".txt"', '"caption"', '".cap.txt"', '".tags_v2"'):
        assert load_config(SDXL, [f"data.caption_ext={good}"]).data.caption_ext == good.strip('"')
    r = CliRunner().invoke(main, ["caption", str(tmp_path), "--caption-ext", "../x"])
    assert r.exit_code == 2 and f"Invalid value for '--caption-ext': '../x' {rule}" in r.output, r.output


def test_train_refuses_an_escaping_run_name_before_writing_anything(tmp_path: Path, small_run) -> None:
    overrides = [*small_run(("01_sky",)), "run.name=../../escaped"]
    r = CliRunner().invoke(main, ["train", str(SDXL), *[x for o in overrides for x in ("--set", o)]])
    assert r.exit_code == 2, r.output
    assert "--set run.name: '../../escaped' is not a plain name" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "runs").exists() and not (tmp_path.parent / "escaped").exists()


def test_export_names_the_key_its_name_came_from() -> None:
    from imglora.errors import ImgloraError
    from imglora.export.writer import export_name

    assert export_name(" toy.safetensors ") == "toy"
    with pytest.raises(ImgloraError, match=r"^export\.name '\.\./x': use a plain file name without folders"):
        export_name("../x", "export.name")
    with pytest.raises(ImgloraError, match=r"^--name 'a/b': use a plain file name"):
        export_name("a/b")


# -- what train checked only once it scanned the data --------------------------------------------


def test_config_reports_the_bucket_step_train_would_refuse_with_every_other_problem() -> None:
    r = config_cli(SDXL, "data.bucket_step=7", "train.warmup_steps=500", "data.buckets=false", "data.resolution=100")
    assert r.exit_code == 2, r.output
    assert "3 problems in the configuration" in r.output
    assert "--set data.bucket_step: 7 must be a multiple of 64 for the sdxl family (e.g. 64, or 0 for the " \
           "family's 64)" in r.output
    assert "--set data.resolution: 100 must be a multiple of 64 with data.buckets = false" in r.output
    assert "train.warmup_steps: 500 warmup steps exceed train.max_steps = 100" in r.output
    assert "--set data.bucket_step: 8 must be a multiple of 16 for the flux family" in \
        "\n".join(problems(FLUX, ["data.bucket_step=8"]))
    assert load_config(FLUX, ["data.bucket_step=32"]).data.bucket_step == 32


def test_train_reports_the_bucket_step_before_the_data_or_model_are_touched(small_run, monkeypatch) -> None:
    from imglora.families import sdxl

    def never(*a, **k):
        raise AssertionError("data or the model were touched")

    for name in ("prepare_data", "load_trainable"):
        monkeypatch.setattr(sdxl.SdxlFamily, name, never)
    args = ["train", str(SDXL)] + [x for o in [*small_run(("01_sky",)), "data.bucket_step=7"] for x in ("--set", o)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert "--set data.bucket_step: 7 must be a multiple of 64 for the sdxl family" in r.output


def test_a_holdout_folder_inside_a_training_set_is_a_config_error(tmp_path: Path) -> None:
    data = tmp_path / "imgs"
    got = problems(SDXL, [f"data.dir={str(data)!r}", f"eval.holdout_dir={str(data / 'held')!r}"])
    assert got == [f"--set eval.holdout_dir: {str(data / 'held')!r} is inside data.dir = {str(data)!r}; move the "
                   "held-out images to a folder of their own, next to data.dir"]
    ok = load_config(SDXL, [f"data.dir={str(data)!r}", f"eval.holdout_dir={str(tmp_path / 'held')!r}"])
    assert ok.eval.holdout_dir == str(tmp_path / "held")


# -- export form and adapter type ---------------------------------------------------------------


def test_flux_kohya_form_with_a_non_lora_adapter_is_refused_in_the_config() -> None:
    for kind in ("dora", "loha", "lokr"):
        got = problems(FLUX, [f'lora.type="{kind}"', 'export.format="kohya"'])
        assert got == [f"--set export.format: kohya fuses q, k and v (and the single blocks' MLP input) into one "
                       f"LoRA per FLUX.1 weight, which only plain LoRA can be, and lora.type = {kind!r}; use "
                       f"export.format = \"default\" (ComfyUI loads {kind} in it, patching each slice) or "
                       "lora.type = \"lora\""]
    assert load_config(FLUX, ['lora.type="lora"', 'export.format="kohya"']).export.format == "kohya"
    assert load_config(FLUX, ['lora.type="dora"', 'export.format="default"']).lora.type == "dora"
    assert load_config(SDXL, ['lora.type="dora"', 'export.format="kohya"']).lora.type == "dora"  # SDXL's holds all


# -- settings that silently did nothing ----------------------------------------------------------


def test_offloading_checkpoints_without_gradient_checkpointing_is_an_error() -> None:
    got = problems(SDXL, ["memory.offload_checkpoints=true", "memory.gradient_checkpointing=false"])
    assert got == ["--set memory.offload_checkpoints: moves what gradient checkpointing keeps to host memory, and "
                   "memory.gradient_checkpointing = false keeps nothing, so it would save no memory; set "
                   "memory.gradient_checkpointing = true, or memory.offload_checkpoints = false"]
    assert load_config(SDXL, ["memory.offload_checkpoints=true"]).memory.offload_checkpoints


@pytest.mark.parametrize("key", ["fp8_compute", "fp8_fused"])
def test_fp8_compute_or_fused_without_fp8_weights_is_an_error(key) -> None:
    got = problems(SDXL, [f"memory.{key}=true"])
    assert got == [f"--set memory.{key}: runs the matmuls of fp8-stored weights, and memory.fp8 = false "
                   f"stores none; set memory.fp8 = true, or memory.{key} = false"]
    assert getattr(load_config(SDXL, [f"memory.{key}=true", "memory.fp8=true"]).memory, key)


def test_a_budget_the_run_ends_before_checking_is_an_error() -> None:
    got = problems(SDXL, ["train.budget.max_hours=1", "train.max_steps=20", "train.budget.smoke_steps=50"])
    assert got == ["--set train.budget.max_hours: the budget guard checks it once, when it projects the session at "
                   "update 55 (3 warm-up + train.budget.smoke_steps = 50 measured updates, at a log: "
                   "train.log_every = 5), but train.max_steps = 20 ends the run first, so it would never act; lower "
                   "train.budget.smoke_steps to at most 12"]
    # At most 12: the guard then projects at update 15, a log before the last update (20).
    assert load_config(SDXL, ["train.budget.max_hours=1", "train.max_steps=20", "train.budget.smoke_steps=12"])
    budget = ["train.budget.max_cost=5", "train.budget.hourly_rate=1", "train.warmup_steps=0"]
    assert problems(SDXL, [*budget, "train.max_steps=6"])[0].endswith("lower train.budget.smoke_steps to at most 2")
    short = problems(SDXL, [*budget, "train.max_steps=4"])
    assert short[0].startswith("--set train.budget.max_cost: the budget guard checks it once")
    assert short[0].endswith("raise train.max_steps or lower train.log_every, or drop the budget for so short a run")


def test_settings_that_do_nothing_or_undo_the_training_are_noted() -> None:
    cfg = load_config(SDXL, ["memory.ema_on_cpu=true", "train.max_steps=20", "train.budget.smoke_steps=50",
                             "data.caption_dropout=1.0", 'data.trigger_word="sks"'])
    assert cfg.notes == (
        "--set memory.ema_on_cpu: does nothing without train.ema = true (there is no moving average to keep in "
        "host memory)",
        "--set train.budget.smoke_steps: 50 measured updates (after 3 warm-up ones) end at update 55, and "
        "train.max_steps = 20: this run is never projected (no session time or cost is printed)",
        "--set data.caption_dropout: 1.0 trains every step on the empty caption, so the captions and the trigger "
        "word 'sks' are never learned; a small rate such as 0.05 keeps the adapter working without its prompt",
    )
    assert load_config(SDXL, ["memory.ema_on_cpu=true", "train.ema=true", "data.caption_dropout=0.99",
                              "train.max_steps=10"]).notes == ()  # the default smoke_steps: no note
    sets = load_config(DATASETS, ["data.sets[1].caption_dropout=1.0"]).notes
    assert len(sets) == 1 and sets[0].startswith("--set data.sets[1].caption_dropout: 1.0 trains every step")
    r = config_cli(SDXL, "data.caption_dropout=1.0")
    assert r.exit_code == 0 and "note: --set data.caption_dropout: 1.0 trains every step" in r.output


def test_config_says_which_packages_train_would_refuse_on_this_machine(monkeypatch) -> None:
    """Packages are the machine's, not the preset's: a note (the preset may be meant for another
    machine), where `train` refuses before loading anything."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "prodigyopt" else real(name, *a))
    r = config_cli(SDXL, 'train.optimizer="prodigy"', "train.learning_rate=1.0")
    assert r.exit_code == 0, r.output
    assert 'note: on this machine train.optimizer = "prodigy" needs prodigyopt: `pip install prodigyopt`; ' \
           "`imglora train` refuses it here" in r.output
    assert "note:" not in config_cli(SDXL).output

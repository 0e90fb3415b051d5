from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from imglora.commands.common import load_config
from imglora import config
from imglora.cli import main
from imglora.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted((REPO / "presets").glob("*.toml"))


def write(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


MINIMAL = """
version = 1
[model]
family = "sdxl"
path = "tiny:sdxl"
[data]
dir = "imgs"
[train]
max_steps = 10
"""


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_every_shipped_preset_loads(preset: Path, tmp_path: Path) -> None:
    cfg = load_config(preset)
    assert cfg.version == config.SCHEMA_VERSION
    assert cfg.run.name == preset.stem
    # The printed config reads back to the same config.
    out = write(tmp_path, cfg.to_toml(), preset.name)
    assert load_config(out) == dataclass_replace_source(cfg, str(out))


def test_printed_config_round_trips(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, MINIMAL))
    out = write(tmp_path, cfg.to_toml(), "p.toml")  # same stem, so run.name is the same
    assert load_config(out) == dataclass_replace_source(cfg, str(out))


def dataclass_replace_source(cfg, source):
    import dataclasses

    return dataclasses.replace(cfg, source=source)


def test_defaults_and_derived_values(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, MINIMAL))
    assert cfg.lora.rank == 16 and cfg.lora.alpha == 16.0  # alpha defaults to rank: scale 1
    assert cfg.run.name == "p"
    assert cfg.run_dir == Path("runs") / "p"
    assert cfg.memory.gradient_checkpointing is True


def test_all_problems_reported_at_once(tmp_path: Path) -> None:
    p = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError) as exc:
        load_config(p, ["train.learnig_rate=1e-4", "train.max_steps=abc", "lora.rank=-3"])
    msg = str(exc.value)
    assert msg.startswith(f"3 problems in the configuration {p}:")
    assert '--set train.learnig_rate: unknown key (did you mean "learning_rate"?)' in msg
    assert '--set train.max_steps: expected an integer, got the string "abc"' in msg
    assert "--set lora.rank: must be at least 1, got -3" in msg


def test_errors_in_file_name_the_file_and_key(tmp_path: Path) -> None:
    p = write(tmp_path, """
version = 1
[model]
family = "sdxl3"
[data]
dir = "x"
resolution = "big"
flip = 1
[train]
max_steps = 10
learning_rate = 0
scheduler = "cosin"
[memroy]
x = 1
""")
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    problems = exc.value.problems
    assert f"{p}: model.family: expected one of 'sdxl', 'flux', 'flux_kontext', 'chroma', 'qwen_image', 'qwen_image_edit', 'qwen_image_edit_plus', 'z_image', 'flux2', 'krea2', 'qwen_image21', 'llm', got the string \"sdxl3\" (did you mean \"sdxl\"?)" in problems
    assert any(f"{p}: model.path: missing required key" in x for x in problems)
    assert f'{p}: data.resolution: expected an integer, got the string "big"' in problems
    assert f"{p}: data.flip: expected true or false, got the integer 1" in problems
    assert f"{p}: train.learning_rate: must be greater than 0.0, got 0.0" in problems
    assert any(x.startswith(f"{p}: train.scheduler: expected one of") and 'did you mean "cosine"' in x for x in problems)
    assert f'{p}: memroy: unknown section (did you mean "memory"?)' in problems
    assert len(problems) == 7


def test_toml_syntax_error_names_the_line(tmp_path: Path) -> None:
    p = write(tmp_path, 'version = 1\n[model]\nfamily = "sdxl\n')
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert f"{p}: TOML syntax error" in str(exc.value)
    assert "line 3" in str(exc.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such preset file"):
        load_config(tmp_path / "nope.toml")


def test_extends_merges_and_errors_name_the_defining_file(tmp_path: Path) -> None:
    base = write(tmp_path, MINIMAL + "\n[lora]\nrank = 32\ndropout = 0.1\n", "base.toml")
    child = write(tmp_path, 'version = 1\nextends = "base.toml"\n[lora]\nrank = 8\n[train]\nbatch_size = 0\n',
                  "child.toml")
    with pytest.raises(ConfigError) as exc:
        load_config(child)
    assert exc.value.problems == [f"{child}: train.batch_size: must be at least 1, got 0"]
    cfg = load_config(child, ["train.batch_size=2"])
    assert (cfg.lora.rank, cfg.lora.dropout, cfg.train.batch_size, cfg.model.family) == (8, 0.1, 2, "sdxl")
    assert cfg.run.name == "child"
    with pytest.raises(ConfigError) as exc:
        load_config(base, ["lora.dropout=2.0"])
    assert exc.value.problems == ["--set lora.dropout: must be at most 0.99, got 2.0"]


def test_extends_cycle(tmp_path: Path) -> None:
    write(tmp_path, 'extends = "b.toml"\n', "a.toml")
    write(tmp_path, 'extends = "a.toml"\n', "b.toml")
    with pytest.raises(ConfigError, match="extends forms a cycle"):
        load_config(tmp_path / "a.toml")


def test_override_typing(tmp_path: Path) -> None:
    p = write(tmp_path, MINIMAL)
    cfg = load_config(p, ["lora.targets=[\"to_q\", \"to_k\"]", "data.trigger_word=sks toy", "train.learning_rate=3e-4",
                          "memory.fp8=true", "lora.alpha=4"])
    assert cfg.lora.targets == ["to_q", "to_k"]
    assert cfg.data.trigger_word == "sks toy"
    assert cfg.train.learning_rate == 3e-4
    assert cfg.memory.fp8 is True
    assert cfg.lora.alpha == 4.0
    with pytest.raises(ConfigError, match=r"--set bogus: expected section.key=value"):
        load_config(p, ["bogus"])


def test_cross_field_checks(tmp_path: Path) -> None:
    p = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError) as exc:
        load_config(p, ["train.max_steps=0", "memory.blocks_to_swap=4", "data.dir="])
    msg = str(exc.value)
    assert "set train.max_steps or train.epochs" in msg
    assert "block swapping is implemented for the flux, flux_kontext, chroma, qwen_image, qwen_image_edit, qwen_image_edit_plus, z_image, flux2, krea2 and qwen_image21 families only" in msg
    assert "data.dir: missing required key for the sdxl family" in msg


def test_fp8_with_4bit_quantization_names_both_keys() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(REPO / "presets" / "tiny-llm.toml", ["memory.fp8=true"])
    msg = str(exc.value)
    assert "memory.fp8 = true and memory.quantization = \"auto\" both quantize the frozen base" in msg


def test_newer_schema_version_is_refused(tmp_path: Path) -> None:
    p = write(tmp_path, MINIMAL.replace("version = 1", "version = 99"))
    with pytest.raises(ConfigError, match="schema version 99.*upgrade imglora"):
        load_config(p)


def test_cli_config_exit_code_and_message(tmp_path: Path) -> None:
    p = write(tmp_path, MINIMAL)
    r = CliRunner().invoke(main, ["config", str(p), "--set", "train.learnig_rate=1e-4", "--set",
                                  "train.max_steps=abc", "--set", "lora.rank=-3"])
    assert r.exit_code == 2
    assert "did you mean \"learning_rate\"" in r.output
    assert "train.max_steps" in r.output and "lora.rank" in r.output
    assert "Traceback" not in r.output
    ok = CliRunner().invoke(main, ["config", str(p), "--set", "lora.rank=4"])
    assert ok.exit_code == 0, ok.output
    assert "[lora]\ntype = \"lora\"\nrank = 4\nalpha = 4.0" in ok.output


def test_every_field_has_help() -> None:
    rows = config.field_help()
    assert rows and all(help_ for _, _, help_ in rows)


def test_schema_1_presets_migrate_to_the_same_config(tmp_path: Path) -> None:
    old = write(tmp_path, """
version = 1
[model]
family = "flux"
path = "tiny:flux"
[data]
dir = "x"
[train]
max_steps = 5
guidance = 3.5
timestep_sampling = "sigmoid"
noise_offset = 0.1
[memory]
double_blocks_to_swap = 2
single_blocks_to_swap = 0
""", "old.toml")
    cfg = load_config(old)
    assert cfg.version == 2 and cfg.family.guidance == 3.5 and cfg.family.timestep_sampling == "sigmoid"
    assert (cfg.family.double_blocks_to_swap, cfg.family.single_blocks_to_swap) == (2, 0)
    # Version 1 ignored another family's key; it is dropped with a note, not refused.
    assert cfg.notes == ("ignored train.noise_offset: only the sdxl family reads it",)
    assert "noise_offset" not in cfg.to_toml()


def test_another_familys_section_or_a_moved_key_is_an_error_that_says_where_it_went(tmp_path: Path) -> None:
    p = write(tmp_path, MINIMAL + '\n[flux]\nguidance = 3.5\n')
    with pytest.raises(ConfigError) as exc:
        load_config(p, ["train.guidance=2"])
    msg = str(exc.value)
    assert "the [flux] section is for the flux family, but model.family = 'sdxl'" in msg
    assert "--set train.guidance: unknown key (schema 2 moved it to flux.guidance)" in msg


def test_keys_lists_every_familys_section() -> None:
    from imglora.families import registry

    keys = {k for k, _, _ in config.field_help(registry)}
    assert {"sdxl.noise_offset", "flux.guidance", "flux.double_blocks_to_swap", "llm.data_file",
            "llm.max_seq_len", "train.learning_rate"} <= keys


def test_adapter_type_keys_belong_to_their_types(tmp_path: Path) -> None:
    p = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError) as exc:
        load_config(p, ['lora.type="loha"', "lora.dropout=0.1", "lora.factor=4", "lora.decompose_both=true",
                        'lora.type2="x"'])
    msg = str(exc.value)
    assert "lora.dropout: applies to lora.type = 'lora' or 'dora' only" in msg and "rank_dropout" in msg
    assert "lora.factor: applies to lora.type = 'lora' or 'lokr' only" not in msg
    assert "lora.factor: applies to lora.type = 'lokr' only" in msg
    assert "lora.decompose_both: applies to lora.type = 'lokr' only" in msg
    assert "lora.type2: unknown key" in msg  # every problem at once
    with pytest.raises(ConfigError, match="lora.effective_conv2d: applies to lora.type = 'loha' or 'lokr' only"):
        load_config(p, ['lora.type="dora"', "lora.effective_conv2d=true"])
    with pytest.raises(ConfigError, match="lora.type: expected one of 'lora', 'dora', 'loha', 'lokr'"):
        load_config(p, ['lora.type="locon"'])
    with pytest.raises(ConfigError, match="lora.factor: must be -1"):
        load_config(p, ['lora.type="lokr"', "lora.factor=0"])
    with pytest.raises(ConfigError, match="the llm family trains lora adapters, not dora"):
        load_config(REPO / "presets" / "tiny-llm.toml", ['lora.type="dora"'])
    from imglora.adapters.inject import conv_settings

    cfg = load_config(p, ['lora.type="lokr"', "lora.rank=8", "lora.alpha=4", "lora.conv_rank=2"])
    assert conv_settings(cfg.lora) == (2, 2.0)  # conv alpha: conv_rank (scale 1) when unset
    cfg = load_config(p, ["lora.rank=8", "lora.alpha=4"])
    assert conv_settings(cfg.lora) == (8, 4.0)  # conv layers as the others

"""Reading presets: TOML (with ``extends``) and ``--set`` overrides into one checked ``Config``.

``load(path, overrides, families)`` returns a ``Config`` or raises one ``ConfigError`` that lists
every problem at once (unknown keys with "did you mean", wrong types, out-of-range values, missing
required keys, TOML syntax errors with their line), each naming the file and the dotted key. It
never loads a model, so a bad preset costs nothing.

``families`` is the family catalog (``imglora.families.registry``): the names that ``model.family``
may take, each family's own section class and its cross-field checks. The loader knows no family;
it asks the catalog.

Relative paths in a preset (``data.dir``, ``cache.dir``, ``run.output_dir``) are relative to the
working directory, as in kohya sd-scripts and ai-toolkit; ``extends`` is relative to the file that
names it. Each file is migrated from its own schema version before files are merged.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Literal, Protocol

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from ..errors import ConfigError
from .schema import REQUIRED, SCHEMA_VERSION, SECTIONS, Config
from .toml_io import toml_value

Where = Callable[[str], str]


class FamilyCatalog(Protocol):
    """What the loader needs to know about model families (implemented by ``families.registry``)."""

    def names(self) -> tuple[str, ...]: ...

    def section(self, name: str) -> type | None: ...  # the dataclass of the family's own [name] section

    def check(self, cfg: Config, where: Where, problems: list[str]) -> None: ...  # family cross-field checks


TOP_LEVEL = ("version", "extends", *SECTIONS)


# ----------------------------------------------------------------------------------------------
# Loading


def load(path: str | Path, overrides: typing.Sequence[str] = (), families: FamilyCatalog | None = None) -> Config:
    """Read a preset (following ``extends``), apply ``--set`` overrides, check everything."""
    if families is None:
        raise TypeError("config.load needs the family catalog: config.load(path, overrides, families.registry)")
    problems: list[str] = []
    origin: dict[str, str] = {}  # dotted key -> where its value came from, for messages
    raw = _read_with_extends(Path(path), problems, origin, (), families)
    if raw is None:
        raise ConfigError(problems, str(path))
    for item in overrides:
        _apply_override(raw, item, problems, origin)
    cfg = _build(raw, origin, problems, default_name=Path(path).stem, source=str(path), families=families)
    if problems:
        raise ConfigError(problems, str(path))
    assert cfg is not None
    return cfg


def from_dict(data: dict[str, Any], families: FamilyCatalog, source: str = "train record",
              overrides: typing.Sequence[str] = ()) -> Config:
    """A ``Config`` from a resolved configuration saved in a record or checkpoint (any schema
    version: it is migrated), checked as a preset is; ``source`` names it in messages."""
    problems: list[str] = []
    origin: dict[str, str] = {}
    raw = _migrate(json.loads(json.dumps(data)), source, problems, origin, families)
    for item in overrides:
        _apply_override(raw, item, problems, origin)
    cfg = _build(raw, origin, problems, default_name=raw.get("run", {}).get("name") or "run", source=source,
                 families=families)
    if problems:
        raise ConfigError(problems, source)
    assert cfg is not None
    return cfg


def _read_toml(path: Path, problems: list[str]) -> dict[str, Any] | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        problems.append(f"{path}: no such preset file")
        return None
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"{path}: cannot read the preset ({exc})")
        return None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # The message ends with "(at line L, column C)"; that is what a user needs.
        problems.append(f"{path}: TOML syntax error: {exc}")
        return None


def _read_with_extends(path: Path, problems: list[str], origin: dict[str, str], chain: tuple[Path, ...],
                       families: FamilyCatalog) -> dict[str, Any] | None:
    resolved = path.resolve()
    if resolved in chain:
        problems.append(f"{path}: extends forms a cycle: " + " -> ".join(str(p) for p in (*chain, resolved)))
        return None
    data = _read_toml(path, problems)
    if data is None:
        return None
    parent = data.pop("extends", None)
    mine: dict[str, str] = {}
    data = _migrate(data, str(path), problems, mine, families)
    merged: dict[str, Any] = {}
    if parent is not None:
        if not isinstance(parent, str) or not parent:
            problems.append(f"{path}: extends: expected the path of another preset, got {parent!r}")
        else:
            base = _read_with_extends(path.parent / parent, problems, origin, (*chain, resolved), families)
            if base is None:
                return None
            merged = base
    _merge_into(merged, data, str(path), origin, prefix="")
    for key, note in mine.items():  # keep "migrated from" notes of this file's keys
        origin[key] = note
    return merged


def _merge_into(dst: dict[str, Any], src: dict[str, Any], where: str, origin: dict[str, str], prefix: str) -> None:
    for key, value in src.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge_into(dst[key], value, where, origin, prefix=f"{dotted}.")
        else:
            dst[key] = value
            _mark(origin, dotted, value, where)


def _mark(origin: dict[str, str], dotted: str, value: Any, where: str) -> None:
    origin[dotted] = where
    if isinstance(value, dict):
        for k, v in value.items():
            _mark(origin, f"{dotted}.{k}", v, where)


def parse_override_value(text: str) -> Any:
    """A ``--set`` value is read as a TOML value (1e-4, true, [\"a\"], \"x\"); anything else is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _apply_override(raw: dict[str, Any], item: str, problems: list[str], origin: dict[str, str]) -> None:
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or "." not in key:
        problems.append(f"--set {item}: expected section.key=value, e.g. --set train.max_steps=100")
        return
    *tables, name = key.split(".")
    table = raw
    for depth, part in enumerate(tables):
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            problems.append(f"--set {key}: {'.'.join(tables[:depth + 1])} is not a table")
            return
    table[name] = parse_override_value(value.strip())
    origin[key] = "--set"


# ----------------------------------------------------------------------------------------------
# Schema versions


MIGRATED = "migrated from "  # origin prefix of a key the migration moved


def moved_keys(families: FamilyCatalog) -> dict[str, str]:
    """{old dotted key: new dotted key} for every field that says where it used to live."""
    out = {}
    sections = [(name, cls) for name, cls in SECTIONS.items()]
    sections += [(name, cls) for name in families.names() if (cls := families.section(name)) is not None]
    for name, cls in sections:
        for f in dataclasses.fields(cls):
            if f.metadata.get("moved_from"):
                out[f.metadata["moved_from"]] = f"{name}.{f.name}"
    return out


def _migrate(raw: dict[str, Any], where: str, problems: list[str], origin: dict[str, str],
             families: FamilyCatalog) -> dict[str, Any]:
    """Bring one file's mapping to the current schema. Version 2 moved the keys only one family reads
    into that family's own section; ``origin`` remembers them, so keys of another family (which
    version 1 ignored) can be dropped with a note rather than refused."""
    version = raw.get("version", SCHEMA_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        problems.append(f"{where}: version: expected a positive integer schema version, got {version!r}")
        return raw
    if version > SCHEMA_VERSION:
        problems.append(f"{where}: version: this preset has schema version {version}, but this imglora "
                        f"reads up to {SCHEMA_VERSION}; upgrade imglora")
        return raw
    if version < 2:
        for old, new in moved_keys(families).items():
            (old_section, old_key), (new_section, new_key) = old.split(".", 1), new.split(".", 1)
            table = raw.get(old_section)
            if isinstance(table, dict) and old_key in table:
                raw.setdefault(new_section, {})[new_key] = table.pop(old_key)
                origin[new] = f"{where} ({MIGRATED}{old})"
    raw["version"] = SCHEMA_VERSION
    return raw


# ----------------------------------------------------------------------------------------------
# Checking


def _build(raw: dict[str, Any], origin: dict[str, str], problems: list[str], default_name: str, source: str,
           families: FamilyCatalog) -> Config | None:
    def where(dotted: str) -> str:
        src = origin.get(dotted) or next((v for k, v in origin.items() if k.startswith(dotted + ".")), source)
        return f"--set {dotted}" if src == "--set" else f"{src}: {dotted}"

    known = (*TOP_LEVEL, *families.names())
    for key in raw:
        if key not in known:
            problems.append(f"{where(key)}: unknown section{_did_you_mean(key, known)}")
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            problems.append(f"{where(name)}: expected a [{name}] table, got {_describe(table)}")
            table = {}
        sections[name] = _build_section(name, cls, table, where, problems, families)
    family_name = raw.get("model", {}).get("family") if isinstance(raw.get("model"), dict) else None
    if family_name is not None and family_name not in families.names():  # a choice the installed families make
        err, _ = _check_value(family_name, Literal[families.names()], {})
        problems.append(f"{where('model.family')}: {err}")
        return None
    if any(s is None for s in sections.values()):
        return None
    notes = []
    for other in families.names():  # another family's section: version 1 ignored it, version 2 refuses it
        table = raw.get(other)
        if other == family_name or not isinstance(table, dict):
            continue
        migrated = {k: origin.get(f"{other}.{k}", "").partition(MIGRATED)[2].rstrip(")") for k in table}
        if not all(migrated.values()):
            problems.append(f"{where(other)}: the [{other}] section is for the {other} family, but model.family = "
                            f"{family_name!r}; remove it or change model.family")
        else:  # keys an old preset set for another family: version 1 ignored them too
            notes.append(f"ignored {', '.join(migrated.values())}: only the {other} family reads "
                         f"{'it' if len(migrated) == 1 else 'them'}")
    family_cls = families.section(family_name)
    family_section = None
    if family_cls is not None:
        table = raw.get(family_name, {})
        if not isinstance(table, dict):
            problems.append(f"{where(family_name)}: expected a [{family_name}] table, got {_describe(table)}")
            table = {}
        family_section = _build_section(family_name, family_cls, table, where, problems, families)
        if family_section is None:
            return None
    if not sections["run"].name:
        sections["run"] = dataclasses.replace(sections["run"], name=default_name)
    if sections["lora"].alpha == 0:
        sections["lora"] = dataclasses.replace(sections["lora"], alpha=float(sections["lora"].rank))
    cfg = Config(version=raw.get("version", SCHEMA_VERSION), source=source, family=family_section,
                 notes=tuple(notes), **sections)
    _cross_checks(cfg, where, problems)
    families.check(cfg, where, problems)
    return cfg


def _build_section(name: str, cls: type, table: dict[str, Any], where: Where, problems: list[str],
                   families: FamilyCatalog) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    ok = True
    for key, value in table.items():
        dotted = f"{name}.{key}"
        if key not in hints:
            moved = moved_keys(families).get(dotted)
            hint = f" (schema 2 moved it to {moved})" if moved else _did_you_mean(key, names)
            problems.append(f"{where(dotted)}: unknown key{hint}")
            continue
        if dataclasses.is_dataclass(hints[key]):  # a sub-table such as [train.budget]
            if not isinstance(value, dict):
                problems.append(f"{where(dotted)}: expected a table, got {_describe(value)}")
                ok = False
                continue
            sub = _build_section(dotted, hints[key], value, where, problems, families)
            ok = ok and sub is not None
            values[key] = sub
            continue
        f = next(f for f in dataclasses.fields(cls) if f.name == key)
        err, coerced = _check_value(value, hints[key], f.metadata)
        if err:
            problems.append(f"{where(dotted)}: {err}")
            ok = False
        else:
            values[key] = coerced
    for f in dataclasses.fields(cls):
        if f.default is REQUIRED and f.default_factory is REQUIRED and f.name not in table:
            problems.append(f"{where(name)}.{f.name}: missing required key ({f.metadata['help']})")
            ok = False
    if not ok:
        return None
    return cls(**values)


def _check_value(value: Any, tp: Any, meta: typing.Mapping[str, Any]) -> tuple[str | None, Any]:
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices and type(value) is type(choices[0]):
            return None, value
        hint = _did_you_mean(str(value), [str(c) for c in choices]) if isinstance(value, str) else ""
        return f"expected one of {', '.join(map(repr, choices))}, got {_describe(value)}{hint}", None
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            return f"expected a list, got {_describe(value)}", None
        for i, item in enumerate(value):
            err, _ = _check_value(item, item_tp, {})
            if err:
                return f"item {i}: {err}", None
        return None, [float(v) if item_tp is float else v for v in value]
    if origin is dict:  # a table passed through as it is (e.g. train.optimizer_args)
        if not isinstance(value, dict):
            return f"expected a table such as {{d_coef = 2}}, got {_describe(value)}", None
        return None, dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return None, value
        return f"expected true or false, got {_describe(value)}", None
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return _check_range(value, meta), value
        return f"expected an integer, got {_describe(value)}", None
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
            if not math.isfinite(value):
                return f"expected a finite number, got {value}", None
            return _check_range(value, meta), value
        return f"expected a number, got {_describe(value)}", None
    if tp is str:
        if isinstance(value, str):
            return None, value
        return f"expected a string, got {_describe(value)}", None
    raise TypeError(f"config field type {tp!r} has no checker")  # a bug in this module, not user input


def _check_range(value: float, meta: typing.Mapping[str, Any]) -> str | None:
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and (value < lo or (meta.get("min_exclusive") and value == lo)):
        bound = f"greater than {lo}" if meta.get("min_exclusive") else f"at least {lo}"
        return f"must be {bound}, got {value}"
    if hi is not None and value > hi:
        return f"must be at most {hi}, got {value}"
    return None


def _cross_checks(cfg: Config, where: Where, problems: list[str]) -> None:
    """Checks across fields that hold for every family; each family adds its own (``families.check``)."""
    t, m, d = cfg.train, cfg.memory, cfg.data
    if t.max_steps == 0 and t.epochs == 0:
        problems.append(f"{where('train.max_steps')}: set train.max_steps or train.epochs to a positive number")
    if m.fp8 and m.quantization != "none":
        problems.append(f"{where('memory.fp8')}: memory.fp8 = true and memory.quantization = "
                        f"\"{m.quantization}\" both quantize the frozen base; choose one (set memory.fp8 = false "
                        "for 4-bit QLoRA, or memory.quantization = \"none\" for fp8)")
    if d.min_bucket_side > d.max_bucket_side:
        problems.append(f"{where('data.min_bucket_side')}: {d.min_bucket_side} is larger than "
                        f"data.max_bucket_side = {d.max_bucket_side}")
    if d.bucket_step > d.resolution:
        problems.append(f"{where('data.bucket_step')}: {d.bucket_step} is larger than data.resolution = {d.resolution}")
    if t.budget.max_cost and not t.budget.hourly_rate:
        problems.append(f"{where('train.budget.max_cost')}: set train.budget.hourly_rate too, or the cost "
                        "cannot be projected")
    _adapter_checks(cfg, where, problems)
    from .. import optimizers

    optimizers.check(cfg, where, problems)
    if t.ema and optimizers.is_schedule_free(t.optimizer):
        problems.append(f"{where('train.ema')}: a schedule-free optimizer already averages its iterates (its eval "
                        "weights are what is saved); train.ema on top is not supported")
    if t.warmup_steps and t.max_steps and t.warmup_steps > t.max_steps:
        problems.append(f"{where('train.warmup_steps')}: {t.warmup_steps} warmup steps exceed "
                        f"train.max_steps = {t.max_steps}")


def _adapter_checks(cfg: Config, where: Where, problems: list[str]) -> None:
    """Each [lora] key belongs to some adapter types; one set for another type is an error, not ignored."""
    lo, kind = cfg.lora, cfg.lora.type
    only = {"dropout": ("lora", "dora"), "rank_dropout": ("loha", "lokr"), "module_dropout": ("loha", "lokr"),
            "effective_conv2d": ("loha", "lokr"), "factor": ("lokr",), "decompose_both": ("lokr",)}
    unset = {"dropout": 0.0, "rank_dropout": 0.0, "module_dropout": 0.0, "effective_conv2d": False, "factor": -1,
             "decompose_both": False}
    for key, kinds in only.items():
        if kind not in kinds and getattr(lo, key) != unset[key]:
            hint = {"dropout": " (LoHa/LoKr: lora.rank_dropout, lora.module_dropout)",
                    "rank_dropout": " (LoRA/DoRA: lora.dropout)", "module_dropout": " (LoRA/DoRA: lora.dropout)"}
            problems.append(f"{where(f'lora.{key}')}: applies to lora.type = {' or '.join(map(repr, kinds))} only, "
                            f"and lora.type = {kind!r}{hint.get(key, '')}")
    if lo.factor == 0:
        problems.append(f"{where('lora.factor')}: must be -1 (automatic) or a positive divisor, got 0")


def _did_you_mean(word: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def _describe(value: Any) -> str:
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "table"}
    kind = kinds.get(type(value), type(value).__name__)
    return f"the {kind} {json.dumps(value, default=str)}"


# ----------------------------------------------------------------------------------------------
# Documenting


def field_help(families: FamilyCatalog | None = None) -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every field, the families' own sections included."""
    rows: list[tuple[str, str, str]] = []

    def walk(prefix: str, cls: type) -> None:
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                walk(f"{prefix}.{f.name}", tp)
                continue
            if f.default is not REQUIRED:
                default = toml_value(f.default)
            elif f.default_factory is not REQUIRED:
                default = toml_value(f.default_factory())
            else:
                default = "(required)"
            rows.append((f"{prefix}.{f.name}", default, f.metadata["help"]))

    for name, cls in SECTIONS.items():
        walk(name, cls)
    for name in families.names() if families else ():
        if (cls := families.section(name)) is not None:
            walk(name, cls)
    return rows

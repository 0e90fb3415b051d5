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
import re
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Literal, Protocol

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from ..errors import ConfigError
from .checks import cross_checks
from .checks import notes as config_notes
from .keys import list_item_class
from .schema import REQUIRED, SCHEMA_VERSION, SECTIONS, Config

Where = Callable[[str], str]


class FamilyCatalog(Protocol):
    """What the loader needs to know about the installed model families and adapter types
    (implemented by ``families.registry``)."""

    def names(self) -> tuple[str, ...]: ...

    def section(self, name: str) -> type | None: ...  # the dataclass of the family's own [name] section

    def check(self, cfg: Config, where: Where, problems: list[str]) -> None: ...  # family and adapter checks

    # The [lora] keys set to a value that means nothing for lora.type: {key: (the value that unsets it, why)}
    def meaningless_lora_keys(self, lo: Any) -> dict[str, tuple[Any, str]]: ...


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


_INDEXED = re.compile(r"(\w+)\[([^\]]*)\]\Z")  # sets[1]; also sets[x] and sets[-1], refused by _index


def _apply_override(raw: dict[str, Any], item: str, problems: list[str], origin: dict[str, str]) -> None:
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or "." not in key:
        problems.append(f"--set {item}: expected section.key=value, e.g. --set train.max_steps=100")
        return
    *tables, name = key.split(".")
    whole_item = bool(_INDEXED.match(name))  # data.sets[0]=...: the index is checked, then refused
    if whole_item:
        tables.append(name)
    table = raw
    for depth, part in enumerate(tables):
        indexed = _INDEXED.match(part)  # data.sets[1].repeats: the second [[data.sets]] table
        table = table.setdefault(indexed[1] if indexed else part, [] if indexed else {})
        if indexed:
            i = _index(key, part, indexed[2], table, ".".join([*tables[:depth], indexed[1]]), problems)
            if i is None:
                return
            table = table[i]
        if not isinstance(table, dict):
            problems.append(f"--set {key}: {'.'.join(tables[:depth + 1])} is not a table")
            return
    if whole_item:
        problems.append(f"--set {key}: that is a whole table; set one of its keys, e.g. --set {key}.repeats=2")
        return
    table[name] = parse_override_value(value.strip())
    origin[key] = "--set"


def _index(key: str, part: str, text: str, items: Any, dotted: str, problems: list[str]) -> int | None:
    """The item ``text`` names in the list of tables ``dotted`` (counted from 0, as TOML lists them),
    or None with a problem that says which indices there are."""
    n = len(items) if isinstance(items, list) else 0
    has = f"the preset has {n} [[{dotted}]] table{'s' if n != 1 else ''}"
    if not n:
        problems.append(f"--set {key}: there is no {part} ({has}; add [[{dotted}]] tables to the preset first)")
        return None
    if not (text.strip().isascii() and text.strip().isdigit()):
        problems.append(f"--set {key}: {part}: the index must be an integer 0…{n - 1} ({has}; counted from 0)")
        return None
    if int(text) >= n:
        problems.append(f"--set {key}: there is no {part} ({has}; the index must be 0…{n - 1})")
        return None
    return int(text)


# ----------------------------------------------------------------------------------------------
# Schema versions


MIGRATED = "migrated from "  # origin prefix of a key the migration moved


def moved_keys(families: FamilyCatalog, prefer: str | None = None) -> dict[str, str]:
    """{old dotted key: new dotted key} for every field that says where it used to live. Families
    built on another's section share its keys: the key goes to ``prefer``'s section (the preset's
    family) where it has the field, else to the first family that has it."""
    out = {}
    sections = [(name, cls) for name, cls in SECTIONS.items()]
    names = sorted(families.names(), key=lambda n: n != prefer)  # the preferred family first
    sections += [(name, cls) for name in names if (cls := families.section(name)) is not None]
    for name, cls in sections:
        for f in dataclasses.fields(cls):
            if f.metadata.get("moved_from"):  # the first family that has the key (one built on another's
                out.setdefault(f.metadata["moved_from"], f"{name}.{f.name}")  # section shares it): its own
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
        model = raw.get("model")
        for old, new in moved_keys(families, model.get("family") if isinstance(model, dict) else None).items():
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
        src = _origin_of(origin, dotted) or source
        return f"--set {dotted}" if src == "--set" else f"{src}: {dotted}"

    known = (*TOP_LEVEL, *families.names())
    for key in raw:
        if key not in known:
            problems.append(f"{where(key)}: unknown section{_did_you_mean(key, known)}")
    sections: dict[str, Any] = {}
    family_name = raw.get("model", {}).get("family") if isinstance(raw.get("model"), dict) else None
    for name, cls in SECTIONS.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            problems.append(f"{where(name)}: expected a [{name}] table, got {_describe(table)}")
            table = {}
        sections[name] = _build_section(name, cls, table, where, problems, families,
                                        prefer=family_name if isinstance(family_name, str) else None)
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
    _drop_inherited_lora_keys(sections, origin, source, notes, families)
    cfg = Config(version=raw.get("version", SCHEMA_VERSION), source=source, family=family_section,
                 notes=tuple(notes), **sections)
    cross_checks(cfg, where, problems)
    families.check(cfg, where, problems)
    return dataclasses.replace(cfg, notes=(*cfg.notes, *config_notes(cfg, where)))


def _drop_inherited_lora_keys(sections: dict[str, Any], origin: dict[str, str], source: str, notes: list[str],
                              families: FamilyCatalog) -> None:
    """A [lora] key that means nothing for the chosen lora.type and was set by a parent preset (which
    the user cannot unset with --set: ``--set lora.type="oft"`` on a preset extending one with
    ``alpha``) is dropped with a note; one set in the preset itself or by --set stays, and is an error."""
    lo = sections["lora"]
    own = {str(Path(source)), "--set"}
    drop = {}
    for key, (unset, why) in families.meaningless_lora_keys(lo).items():
        src = _origin_of(origin, f"lora.{key}")
        if src and src.partition(" (")[0] not in own:
            drop[key] = unset
            notes.append(f"lora.{key} = {getattr(lo, key)!r} from the parent preset {src.partition(' (')[0]} is dropped: "
                         f"it {why.removeprefix('it ')}")
    if drop:
        sections["lora"] = dataclasses.replace(lo, **drop)


_LAST_PART = re.compile(r"(\[\d+\]|\.[^.\[\]]*)$")  # ".key" or "[3]" at the end of a dotted key


def _origin_of(origin: dict[str, str], dotted: str) -> str | None:
    """Where a key was set: the key itself, a key under it (a section), or the nearest key above it
    (for ``data.sets[1].dir``: where the list ``data.sets`` was set)."""
    found = origin.get(dotted) or next((v for k, v in origin.items() if k.startswith(dotted + ".")), None)
    key = dotted
    while found is None and (parent := _LAST_PART.sub("", key)) != key:
        key = parent
        found = origin.get(key)
    return found


def _build_section(name: str, cls: type, table: dict[str, Any], where: Where, problems: list[str],
                   families: FamilyCatalog, base: dict[str, Any] | None = None,
                   outer: tuple[str, set[str]] | None = None, prefer: str | None = None) -> Any:
    """The dataclass ``cls`` from ``table``; ``base`` holds checked values to start from (what an item
    of a list of tables takes from the enclosing table), ``outer`` that table's name and keys."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = dict(base or {})
    ok = True
    lists: list[tuple[str, Any]] = []
    for key, value in table.items():
        dotted = f"{name}.{key}"
        if key not in hints:
            moved = moved_keys(families, prefer).get(dotted)
            other = getattr(cls, "other_names", {}).get(key)
            if moved:
                hint = f" (schema 2 moved it to {moved})"
            elif outer is not None and key in outer[1]:
                hint = f" (it applies to every set: set it in [{outer[0]}])"
            elif other:
                hint = f" (that is another trainer's name; imglora's is {other})"
            else:
                hint = _did_you_mean(key, names)
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
        if list_item_class(hints[key]) is not None:  # after the other keys: items may inherit them
            lists.append((key, value))
            continue
        f = next(f for f in dataclasses.fields(cls) if f.name == key)
        err, coerced = _check_value(value, hints[key], f.metadata)
        if err:
            problems.append(f"{where(dotted)}: {err}")
            ok = False
        else:
            values[key] = coerced
    for key, value in lists:  # a list of tables such as [[data.sets]]
        item_cls = list_item_class(hints[key])
        item_names = {f.name for f in dataclasses.fields(item_cls)}
        inherit = next(f for f in dataclasses.fields(cls) if f.name == key).metadata.get("inherit")
        given = {k: v for k, v in values.items() if k in item_names} if inherit else {}
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            problems.append(f"{where(f'{name}.{key}')}: expected tables ([[{name}.{key}]]), got {_describe(value)}")
            ok = False
            continue
        items = [_build_section(f"{name}.{key}[{i}]", item_cls, v, where, problems, families, base=given,
                                outer=(name, set(names) - item_names)) for i, v in enumerate(value)]
        ok = ok and all(item is not None for item in items)
        values[key] = items
    for f in dataclasses.fields(cls):
        if f.default is REQUIRED and f.default_factory is REQUIRED and f.name not in table and f.name not in values:
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


def _did_you_mean(word: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def _describe(value: Any) -> str:
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "table"}
    kind = kinds.get(type(value), type(value).__name__)
    return f"the {kind} {json.dumps(value, default=str)}"

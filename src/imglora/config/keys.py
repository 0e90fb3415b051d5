"""What the configuration's keys are: each dotted key with its default and help (``imglora config
--keys``), which may differ on ``--resume``, and the item class of a list of tables."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from .schema import REQUIRED, SECTIONS, Config


def list_item_class(tp: Any) -> type | None:
    """The dataclass of a ``list[SomeConfig]`` field (a list of tables), else None."""
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        if dataclasses.is_dataclass(item):
            return item
    return None


def resume_safe_keys(cfg: Config) -> set[str]:
    """Dotted keys that may differ on ``--resume`` (fields marked ``resume_safe``); an item of a list
    of tables is written ``data.sets[].dir``."""
    out: set[str] = set()

    def walk(prefix: str, cls: type) -> None:
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.type) or (isinstance(f.default_factory, type)
                                                    and dataclasses.is_dataclass(f.default_factory)):
                walk(f"{prefix}{f.name}.", f.default_factory if f.default_factory is not REQUIRED else f.type)
            elif (item := list_item_class(typing.get_type_hints(cls)[f.name])) is not None:
                walk(f"{prefix}{f.name}[].", item)  # data.sets[].dir: any item's dir
            elif f.metadata.get("resume_safe"):
                out.add(prefix + f.name)

    for name, cls in SECTIONS.items():
        walk(f"{name}.", cls)
    if cfg.family is not None:
        walk(f"{cfg.model.family}.", type(cfg.family))
    return out


def field_help(families: Any = None) -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every field, the families' own sections included (``families``:
    the loader's family catalog). A key a list of tables also takes says so."""
    return [(f["key"], f["default"], f["help"]) for f in field_specs(families)]


def field_specs(families: Any = None, cfg: Config | None = None) -> list[dict[str, Any]]:
    """Every field as a dict: ``key``, ``default`` and ``help`` (as :func:`field_help`), its ``type``
    (bool, int, float, str, choice, or toml for lists, tables and the rest, written as TOML),
    ``choices`` (a choice's values), ``min``/``max``, and with ``cfg`` its ``value`` there, as TOML
    (a family's section only for ``cfg``'s family). The UI's form is made from these."""
    from .toml_io import toml_value

    rows: list[dict[str, Any]] = []

    def walk(prefix: str, cls: type, current: Any) -> None:
        hints = typing.get_type_hints(cls)
        also: dict[str, str] = {}
        for f in dataclasses.fields(cls):
            if (item := list_item_class(hints[f.name])) is not None and f.metadata.get("inherit"):
                also.update({g.name: f" Also per [[{prefix}.{f.name}]] table." for g in dataclasses.fields(item)})
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            value = getattr(current, f.name) if current is not None else None
            if dataclasses.is_dataclass(tp):
                walk(f"{prefix}.{f.name}", tp, value)
                continue
            if f.default is not REQUIRED:
                default = toml_value(f.default)
            elif f.default_factory is not REQUIRED:
                default = toml_value(f.default_factory())
            else:
                default = "(required)"
            kind, choices = _kind(tp)
            row = {"key": f"{prefix}.{f.name}", "default": default, "help": f.metadata["help"] + also.get(f.name, ""),
                   "type": kind, "choices": choices, "min": f.metadata.get("min"), "max": f.metadata.get("max")}
            if current is not None and list_item_class(tp) is None:
                row["value"] = toml_value(value)
            rows.append(row)

    for name, cls in SECTIONS.items():
        walk(name, cls, getattr(cfg, name) if cfg is not None else None)
    for name in families.names() if families else ():
        if (cls := families.section(name)) is not None:
            own = cfg is not None and cfg.model.family == name and cfg.family is not None
            walk(name, cls, cfg.family if own else None)
    return rows


def _kind(tp: Any) -> tuple[str, list[Any]]:
    """The form widget of a field's type: (kind, choices)."""
    if tp is bool:
        return "bool", []
    if tp in (int, float, str):
        return tp.__name__, []
    if typing.get_origin(tp) is typing.Literal:
        return "choice", list(typing.get_args(tp))
    return "toml", []

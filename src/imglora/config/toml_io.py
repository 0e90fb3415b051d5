"""Writing a resolved configuration back as TOML (``imglora config`` prints it; records keep it)."""

from __future__ import annotations

import json
from typing import Any


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{json.dumps(k) if not k.isidentifier() else k} = {toml_value(v)}"
                               for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _is_tables(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def dumps_toml(data: dict[str, Any], prefix: str = "", array: bool = False) -> str:
    """Write a mapping of scalars, lists, nested tables and lists of tables (``[[a.b]]``) as TOML."""
    head = [f"{k} = {toml_value(v)}" for k, v in data.items() if not isinstance(v, dict) and not _is_tables(v)]
    parts = []
    if head or array:
        title = f"[[{prefix}]]" if array else f"[{prefix}]"
        parts.append("\n".join(([title] if prefix else []) + head))
    for name, value in data.items():
        inner = f"{prefix}.{name}" if prefix else name
        if isinstance(value, dict):
            parts.append(dumps_toml(value, inner).rstrip("\n"))
        elif _is_tables(value):
            parts += [dumps_toml(table, inner, array=True).rstrip("\n") for table in value]
    return "\n\n".join(parts) + "\n"

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


def dumps_toml(data: dict[str, Any], prefix: str = "") -> str:
    """Write a mapping of scalars, lists and nested tables as TOML."""
    head = [f"{k} = {toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    parts = []
    if head:
        parts.append("\n".join(([f"[{prefix}]"] if prefix else []) + head))
    for name, table in data.items():
        if isinstance(table, dict):
            parts.append(dumps_toml(table, f"{prefix}.{name}" if prefix else name).rstrip("\n"))
    return "\n\n".join(parts) + "\n"

"""A small JSON Schema validator for the subset miniverl's schemas use.

Keywords: type (one name or a list), required, properties, additionalProperties
(true, false or a schema), items, enum, minimum. Annotations ($schema, title,
description, ...) are ignored. Every problem is reported, each naming its
path the way `$.provenance.torch: expected string, got integer` does.
"""

from __future__ import annotations

import re
from typing import Any

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _is(value: Any, name: str) -> bool:
    actual = json_type(value)
    return actual == name or (name == "number" and actual == "integer")


def child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if _IDENTIFIER.match(key) else f'{path}["{key}"]'


def validate(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """Every way `value` breaks `schema`, one line each; empty when it conforms."""
    problems: list[str] = []
    if "type" in schema:
        wanted = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is(value, name) for name in wanted):
            return [f"{path}: expected {' or '.join(wanted)}, got {json_type(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{path}: expected one of {', '.join(map(repr, schema['enum']))}, got {value!r}")
    if "minimum" in schema and json_type(value) in ("integer", "number") and value < schema["minimum"]:
        problems.append(f"{path}: expected >= {schema['minimum']}, got {value}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                problems.append(f"{child(path, key)}: required field is missing")
        extra = schema.get("additionalProperties", True)
        for key, inner in value.items():
            if key in properties:
                problems += validate(inner, properties[key], child(path, key))
            elif extra is False:
                problems.append(f"{child(path, key)}: unexpected field (the schema does not define it)")
            elif isinstance(extra, dict):
                problems += validate(inner, extra, child(path, key))
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            problems += validate(item, schema["items"], child(path, index))
    return problems

"""Every way a document breaks a JSON Schema, one plain-worded `Problem` each.

The schemas are generated from msgspec Structs (`msgspec.json.schema`), so the
Struct stays the one source of what a recipe or a hardware result may hold.
msgspec.convert stops at the first error; a jsonschema validator finds them
all, which lets a user fix a file in one attempt. Each error is named by the
path of the key at fault (a missing key's own path, not its parent's) and, for
a bad value, by what the schema expected and what was found:
`expected integer >= 1; got integer 0`. Callers word paths and the
missing/unknown kinds their own way (`recipe key a.b` or `$.a.b`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterator, Literal, NamedTuple

from miniverl.engine.core.errors import UserError

if TYPE_CHECKING:
    from jsonschema.exceptions import ValidationError
    from jsonschema.protocols import Validator

KeyPath = tuple[Any, ...]  # mapping keys and list indices from the document's root
DRAFT = "https://json-schema.org/draft/2020-12/schema"

# The keywords whose failure `_expected` spells out from the schema; any other keyword keeps jsonschema's message.
_DESCRIBED = {"type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "anyOf", "oneOf"}
_WORDS = {"object": "a mapping", "array": "a list"}


class Problem(NamedTuple):
    path: KeyPath
    kind: Literal["missing", "unknown", "invalid"]
    detail: str = ""  # for `invalid`: "expected ...; got ..."


def _is_integer(_checker: object, value: object) -> bool:
    # As msgspec decodes: 3.0 is not an integer and neither is True (JSON Schema alone accepts 3.0).
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(_checker: object, value: object) -> bool:
    # NaN passes every JSON Schema bound (each comparison is false) but fails msgspec's; refuse it here.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def strict_validator(schema: Any, source: str = "schema") -> Validator:
    """A validator of the schema's own draft (2020-12 when it names none), with msgspec's integers and numbers."""
    import jsonschema  # on first use: its ~0.1 s import is not paid by commands that check no schema

    base = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        base.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise UserError(f"{source} is not a valid JSON Schema: {exc.message}") from None
    checker = base.TYPE_CHECKER.redefine_many({"integer": _is_integer, "number": _is_number})
    return jsonschema.validators.extend(base, type_checker=checker)(schema)


def problems(validator: Validator, document: Any) -> list[Problem]:
    """Every problem of `document`, each once, in the order its keys appear in the document."""
    found: list[Problem] = []
    for error in validator.iter_errors(document):
        for leaf in _leaves(error):
            found += _describe(leaf, validator.schema)
    return sorted(dict.fromkeys(found), key=lambda problem: _position(document, problem.path))


def _position(document: Any, path: KeyPath) -> tuple[int, ...]:
    """Where `path` sits when the document is read top to bottom; a missing key after its mapping's keys."""
    position: list[int] = []
    node = document
    for key in path:
        if isinstance(node, dict) and key in node:
            position.append(list(node).index(key))
            node = node[key]
        elif isinstance(node, dict):
            position.append(len(node))
            break
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            position.append(key)
            node = node[key]
        else:
            break
    return tuple(position)


def _leaves(error: ValidationError) -> Iterator[ValidationError]:
    """An anyOf error stands for the errors of its one branch of the value's own type, when there is one.

    `adapter: {path: 3}` against `TeacherAdapterSpec | None` is about `adapter.path`, not about
    `adapter` being neither a mapping nor null."""
    if error.validator in ("anyOf", "oneOf") and error.context:
        branches: dict[int, list[ValidationError]] = {}
        for inner in error.context:
            branches.setdefault(inner.relative_schema_path[0], []).append(inner)
        fitting = [errors for errors in branches.values()
                   if not any(e.validator == "type" and not e.relative_path for e in errors)]
        if len(fitting) == 1:
            for inner in fitting[0]:
                yield from _leaves(inner)
            return
    yield error


def _describe(error: ValidationError, root: dict[str, Any]) -> list[Problem]:
    path = tuple(error.absolute_path)
    if error.validator == "required":  # one error per missing key, but it does not say which: recompute
        return [Problem((*path, key), "missing") for key in error.validator_value if key not in error.instance]
    if error.validator == "additionalProperties" and error.validator_value is False:
        known = error.schema.get("properties", {})
        patterns = error.schema.get("patternProperties", {})
        return [Problem((*path, key), "unknown") for key in error.instance
                if key not in known and not any(re.search(p, str(key)) for p in patterns)]
    if error.validator in _DESCRIBED:
        detail = f"expected {_expected(error.schema, root)}; got {_shown(error.instance)}"
        if error.validator in ("maximum", "exclusiveMaximum") and "description" in error.schema:
            detail += f"; {error.schema['description']}"  # why the ceiling is where it is
        return [Problem(path, "invalid", detail)]
    return [Problem(path, "invalid", error.message)]


def _resolve(ref: str, root: dict[str, Any]) -> dict[str, Any] | None:
    """A `#/...` reference inside the document's own schema (msgspec writes only `#/$defs/Name`)."""
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _expected(schema: dict[str, Any], root: dict[str, Any]) -> str:
    """What `schema` accepts, in words: `integer >= 1`, `one of 'a', 'b'`, `string or null`."""
    if "$ref" in schema:
        target = _resolve(schema["$ref"], root)
        return _expected(target, root) if target is not None else f"a value matching {schema['$ref']}"
    for combinator in ("anyOf", "oneOf"):
        if combinator in schema:
            return " or ".join(dict.fromkeys(_expected(branch, root) for branch in schema[combinator]))
    if "enum" in schema:
        return "one of " + ", ".join(_literal(value) for value in schema["enum"])
    if "const" in schema:
        return _literal(schema["const"])
    types = schema.get("type", [])
    names = " or ".join(_WORDS.get(name, name) for name in ([types] if isinstance(types, str) else types))
    bounds = " and ".join(f"{sign} {_literal(schema[key])}" for key, sign in (
        ("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")) if key in schema)
    return " ".join(part for part in (names, bounds) if part) or "a valid value"


def _literal(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        # typing caches Annotated[float, Meta(ge=0)] and Meta(ge=0.0) as one type (they compare equal),
        # so which spelling a generated schema carries depends on import order: print both alike.
        return repr(int(value))
    return repr(value)


def _shown(value: Any) -> str:
    """The value found, with its JSON kind: `integer 0`, `string 'ten'`, `a list`."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else f"boolean {_literal(value)}"
    if isinstance(value, (int, float, str)):
        kind = "integer" if isinstance(value, int) else "number" if isinstance(value, float) else "string"
        text = repr(value)
        return f"{kind} {text if len(text) <= 60 else text[:57] + '...'}"
    if isinstance(value, (list, dict)):
        return "a list" if isinstance(value, list) else "a mapping"
    return f"{type(value).__name__} {value}"  # YAML can also produce dates and the like

"""The child process that imports a user's tools module and runs its functions.

User code never runs in the training process: `user_tools` starts this module
as `python -m miniverl.engine.tasks.tool_worker [--memory-bytes N] PATH` and
talks JSON lines with it, or runs it once with `--describe` to learn the
tools' schemas. Before the module is imported the worker caps its own address
space and moves the protocol onto private file descriptors, so a function that
prints, reads stdin or allocates without bound cannot corrupt the protocol or
take the run down with it; the parent enforces the time budget by killing us.

Protocol (one JSON object per line): the worker first writes `{"ready": true}`
or `{"error": "..."}`; then for each request `{"name", "arguments",
"max_bytes"}` it writes `{"ok": bool, "text": str}`. `--describe` writes one
line, `{"specs": [...]}` or `{"error": "..."}`, and exits.

This file imports only the standard library: it is the worker's start-up cost.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import IO, Any, Callable, Literal

MODULE_NAME = "_miniverl_user_tools"
TRUNCATED = " ...(truncated)"
_HINT = "annotate it (str, int, float, bool, list[...], Literal[...])"
_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_ARGS_HEADERS = ("Args:", "Arguments:", "Parameters:", "Params:")
_SECTION_RE = re.compile(r"^(Args|Arguments|Parameters|Params|Returns?|Yields?|Raises|Examples?|Notes?|Attributes"
                         r"|See Also|Todo|Warnings?):\s*$")
_ARG_RE = re.compile(r"^\*{0,2}(?P<name>[A-Za-z_]\w*)\s*(?:\([^)]*\))?\s*:\s*(?P<desc>.*)$")


class SpecError(Exception):
    """The module cannot be served as tools; the message is the one line the user sees."""


# --- describing a module ------------------------------------------------------


def load_module(path: str) -> types.ModuleType:
    """Import the file as a module of its own name-space (never under its stem, which may shadow a real module)."""
    sys.path.insert(0, str(Path(path).resolve().parent))  # so the module can import its sibling files
    try:
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
        if spec is None or spec.loader is None:
            raise SpecError(f"{path}: not a Python file; give a .py file of tool functions")
        module = importlib.util.module_from_spec(spec)
        sys.modules[MODULE_NAME] = module  # dataclasses and pickle-free typing look the module up here
        spec.loader.exec_module(module)
    except SpecError:
        raise
    except BaseException as exc:  # noqa: BLE001 - user code: any failure (SystemExit too) is one line
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise SpecError(f"{path}: importing it failed: {exception_line(exc)}") from None
    return module


def public_functions(module: types.ModuleType) -> dict[str, Callable[..., Any]]:
    """The functions defined in the module itself, in definition order, without `_`-names or imported ones."""
    return {name: obj for name, obj in vars(module).items()
            if inspect.isfunction(obj) and not name.startswith("_") and obj.__module__ == module.__name__}


def describe(module: types.ModuleType, path: str) -> list[dict[str, Any]]:
    """Each public function's name, description and parameter schema; SpecError on the first problem."""
    functions = public_functions(module)
    if not functions:
        raise SpecError(f'{path}: no public function; define at least one function whose name does not start with "_"')
    return [function_spec(name, fn, path)[0] for name, fn in functions.items()]


def function_spec(name: str, fn: Callable[..., Any], path: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The tool entry of one function, and the optional parameters without a default (passed as None when omitted)."""
    where = f"{path}: tool {name}"
    doc = inspect.getdoc(fn) or ""
    description = _first_paragraph(doc)
    if not description:
        raise SpecError(f"{where}: no docstring; its first paragraph is the description the model reads")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # noqa: BLE001 - an unresolvable forward reference, a bad annotation
        raise SpecError(f"{where}: its type hints do not resolve: {exception_line(exc)}") from None
    arg_docs = _arg_docs(doc)
    properties: dict[str, Any] = {}
    required: list[str] = []
    fill_none: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        at = f"{where}, parameter {param.name}"
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            star = "*" if param.kind is param.VAR_POSITIONAL else "**"
            raise SpecError(f"{at}: {star}{param.name} is not supported; give each argument its own typed parameter")
        if param.kind is param.POSITIONAL_ONLY:
            raise SpecError(f"{at}: positional-only parameters are not supported (tools are called by keyword); "
                            "remove the /")
        if param.name not in hints:
            raise SpecError(f"{at}: no type hint; {_HINT}")
        hint, optional = _split_optional(hints[param.name])
        schema = _type_schema(hint)
        if schema is None:
            raise SpecError(f"{at}: unsupported type hint {_show_type(hints[param.name])}; {_HINT}")
        has_default = param.default is not param.empty
        if has_default and param.default is not None and _json_ok(param.default):
            schema["default"] = param.default
        if param.name in arg_docs:
            schema["description"] = arg_docs[param.name]
        properties[param.name] = schema
        if not (optional or has_default):
            required.append(param.name)
        elif optional and not has_default:
            fill_none.append(param.name)
    parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"name": name, "description": description, "parameters": parameters}, tuple(fill_none)


def _split_optional(hint: Any) -> tuple[Any, bool]:
    """`X | None` and `Optional[X]` as (X, True); anything else as (hint, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(rest) < len(args):
            return rest[0], True
    return hint, False


def _type_schema(hint: Any) -> dict[str, Any] | None:
    """The JSON schema of a supported annotation, or None."""
    scalar = next((kind for t, kind in _SCALARS.items() if hint is t), None)  # `is`: hints need not be hashable
    if scalar is not None:
        return {"type": scalar}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list and len(args) == 1:
        items = _type_schema(args[0])
        return None if items is None else {"type": "array", "items": items}
    if origin is Literal and args and all(type(v) in _SCALARS for v in args):
        kinds = {_SCALARS[type(v)] for v in args}
        schema: dict[str, Any] = {"enum": list(args)}
        if len(kinds) == 1:
            schema["type"] = kinds.pop()
        return schema
    return None


def _show_type(hint: Any) -> str:
    return inspect.formatannotation(hint).replace("\n", " ")


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _first_paragraph(doc: str) -> str:
    """The docstring's lines up to the first blank line or section header, joined."""
    lines: list[str] = []
    for line in doc.splitlines():
        if not line.strip() or _SECTION_RE.match(line.strip()):
            break
        lines.append(line.strip())
    return " ".join(lines)


def _arg_docs(doc: str) -> dict[str, str]:
    """Per-parameter descriptions from a Google-style `Args:` section (continuation lines joined)."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() in _ARGS_HEADERS), None)
    if start is None:
        return {}
    base = _indent(lines[start])
    docs: dict[str, str] = {}
    current: str | None = None
    entry_indent: int | None = None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        indent = _indent(line)
        if indent <= base:
            break  # the next section
        match = _ARG_RE.match(line.strip())
        if match and (entry_indent is None or indent <= entry_indent):
            entry_indent, current = indent, match.group("name")
            docs[current] = match.group("desc").strip()
        elif current is not None:
            docs[current] = f"{docs[current]} {line.strip()}".strip()
    return docs


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


# --- running calls ------------------------------------------------------------


def exception_line(exc: BaseException) -> str:
    """`Type: message` on one line (the last line of a multi-line message, as a traceback ends)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1].strip()}" if lines else type(exc).__name__


def result_text(value: Any) -> str:
    """What the model reads: JSON for dicts and lists, `str()` for anything else."""
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def cut(text: str, max_bytes: int) -> str:
    """`text` within `max_bytes` of UTF-8, the cut marked (the marker counted), never splitting a character."""
    data = text.encode("utf-8", errors="replace")  # lone surrogates would not survive the pipe
    if len(data) <= max_bytes:
        return data.decode("utf-8")
    keep = max(0, max_bytes - len(TRUNCATED))
    return data[:keep].decode("utf-8", errors="ignore") + TRUNCATED


def run_call(functions: dict[str, tuple[Callable[..., Any], tuple[str, ...]]], request: dict[str, Any]) -> dict[str, Any]:
    """One request's reply; every failure of the user's function is an error text, not a dead worker."""
    name, arguments = request.get("name"), request.get("arguments")
    max_bytes = int(request.get("max_bytes", 4096))
    if name not in functions or not isinstance(arguments, dict):
        return {"ok": False, "text": cut(f"error: no tool {name!r} in this module", max_bytes)}
    fn, fill_none = functions[name]
    kwargs = {p: None for p in fill_none} | arguments
    try:
        return {"ok": True, "text": cut(result_text(fn(**kwargs)), max_bytes)}
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - user code; KeyboardInterrupt still stops the worker
        return {"ok": False, "text": cut(f"error: {exception_line(exc)}", max_bytes)}


def serve(module: types.ModuleType, path: str, requests: IO[bytes], replies: IO[bytes]) -> None:
    functions = {name: (fn, function_spec(name, fn, path)[1]) for name, fn in public_functions(module).items()}
    _send(replies, {"ready": True})
    for line in requests:
        try:
            request = json.loads(line)
        except json.JSONDecodeError:
            request = {}
        _send(replies, run_call(functions, request if isinstance(request, dict) else {}))


def _send(replies: IO[bytes], message: dict[str, Any]) -> None:
    replies.write(json.dumps(message).encode() + b"\n")  # ASCII-escaped: the pipe carries bytes
    replies.flush()


# --- process set-up -----------------------------------------------------------


def isolate_stdio() -> tuple[IO[bytes], IO[bytes]]:
    """Move the protocol to private descriptors; fd 0 becomes /dev/null and fd 1 goes where stderr goes.

    Done at the descriptor level, so prints from C extensions and subprocesses
    the user's code starts cannot reach the protocol either.
    """
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    sys.stdin = open(os.devnull)  # lives as long as the process
    return requests, replies


def limit_memory(max_bytes: int) -> None:
    """Cap the address space, so a runaway allocation is a MemoryError in the tool, not a host out of memory."""
    if max_bytes <= 0:
        return
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = max_bytes if hard == resource.RLIM_INFINITY else min(max_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def main(argv: list[str]) -> int:
    describe_only = "--describe" in argv
    args = [a for a in argv if a != "--describe"]
    memory_bytes = 0
    if len(args) >= 2 and args[0] == "--memory-bytes":
        memory_bytes, args = int(args[1]), args[2:]
    if len(args) != 1:
        sys.stderr.write("usage: python -m miniverl.engine.tasks.tool_worker [--describe] [--memory-bytes N] PATH\n")
        return 2
    path = args[0]
    requests, replies = isolate_stdio()
    # A tool call is one small computation; numeric libraries' per-core thread pools would spend the
    # address-space cap on buffers (OpenBLAS on a many-core host), so they get one thread unless told otherwise.
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")
    limit_memory(memory_bytes)
    try:
        module = load_module(path)
        specs = describe(module, path)
    except SpecError as exc:
        _send(replies, {"error": str(exc)})
        return 1
    if describe_only:
        _send(replies, {"specs": specs})
        return 0
    try:
        serve(module, path, requests, replies)
    except (KeyboardInterrupt, BrokenPipeError):
        pass  # the run is stopping or the parent is gone
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

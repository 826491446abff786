"""User tool modules: schemas read in a child process, calls run in a bounded, restartable worker."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from miniverl.engine.core.errors import UserError
from miniverl.engine.tasks.base import ToolResult
from miniverl.engine.tasks.task_files import TaskFileError
from miniverl.engine.tasks.user_tools import ToolWorker, UserTool, load_tool_specs, load_user_tools

TOOLS = '''
from __future__ import annotations

import os
import time
from os.path import join  # imported: not a tool
from typing import Literal, Optional


def add(a: int, b: int) -> int:
    """Add two integers.

    The second paragraph is not part of the description.

    Args:
        a: first
        b (int): second,
            the one added to a
    """
    return a + b


def search(query: str, mode: Literal["fast", "exact"], tags: list[str], limit: Optional[int],
           scale: float | None = None, verbose: bool = False) -> dict:
    """Search the notes
    for a query.
    Args:
        query: what to look for
    """
    return {"query": query, "mode": mode, "tags": tags, "limit": limit, "scale": scale, "verbose": verbose}


def fail(message: str) -> str:
    """Raise a ValueError."""
    raise ValueError(message)


def hang() -> str:
    """Never return."""
    while True:
        time.sleep(1)


def chatty() -> str:
    """Print to stdout, from Python and below it, then answer."""
    print("noise from print")
    os.write(1, b"noise on fd 1\\n")
    return "quiet answer"


def huge() -> str:
    """A 1 MB answer."""
    return "x" * 1_000_000


def greedy() -> str:
    """Allocate far past the memory cap."""
    return str(len(bytearray(4 << 30)))


def reads_stdin() -> str:
    """Read the protocol's stdin, if it could."""
    return input()


def crash() -> str:
    """Kill the worker."""
    os._exit(3)


def pid() -> int:
    """The worker's process id."""
    return os.getpid()


def _helper() -> None:
    """Private: not a tool."""
'''


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(TOOLS)
    return path


@pytest.fixture(scope="module")
def tools(tools_file: Path):
    loaded = {tool.name: tool for tool in load_user_tools(tools_file, timeout_s=0.5)}
    yield loaded
    next(iter(loaded.values())).close()


def test_specs_come_from_signatures_and_docstrings(tools_file: Path) -> None:
    specs = {spec.name: spec for spec in load_tool_specs(tools_file)}
    assert list(specs) == ["add", "search", "fail", "hang", "chatty", "huge", "greedy", "reads_stdin", "crash", "pid"]
    assert specs["add"].description == "Add two integers."
    assert specs["add"].parameters == {
        "type": "object",
        "properties": {"a": {"type": "integer", "description": "first"},
                       "b": {"type": "integer", "description": "second, the one added to a"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    assert specs["search"].description == "Search the notes for a query."
    assert specs["search"].parameters == {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "what to look for"},
                       "mode": {"enum": ["fast", "exact"], "type": "string"},
                       "tags": {"type": "array", "items": {"type": "string"}},
                       "limit": {"type": "integer"},
                       "scale": {"type": "number"},
                       "verbose": {"type": "boolean", "default": False}},
        "required": ["query", "mode", "tags"],
        "additionalProperties": False,
    }


def test_schema_checks_arguments(tools) -> None:
    search: UserTool = tools["search"]
    assert search.argument_error({"query": "q", "mode": "fast", "tags": []}) is None
    assert "Additional properties" in search.argument_error({"query": "q", "mode": "fast", "tags": [], "extra": 1})
    assert search.argument_error({"query": "q", "mode": "slow", "tags": []}) is not None
    assert search.schema()["function"]["name"] == "search"


def test_calls_run_in_a_worker(tools) -> None:
    assert (tools["add"].run({"a": 2, "b": 40}).text, tools["add"].run({"a": 2, "b": 40}).ok) == ("42", True)
    # An optional parameter without a default is passed as None; dicts come back as JSON.
    result = tools["search"].run({"query": "q", "mode": "fast", "tags": ["a"]})
    assert result.ok and result.text == ('{"query": "q", "mode": "fast", "tags": ["a"], "limit": null, '
                                         '"scale": null, "verbose": false}')
    # One worker serves every tool of the module, and it is not the training process.
    assert tools["pid"].run({}).text == tools["pid"].run({}).text != str(os.getpid())


def test_exceptions_become_error_results(tools) -> None:
    result = tools["fail"].run({"message": "no such note"})
    assert result.text == "error: ValueError: no such note" and result.ok is False
    assert tools["greedy"].run({}).text.startswith("error: MemoryError")
    assert tools["reads_stdin"].run({}).text.startswith("error: EOFError")  # stdin is not the protocol
    assert tools["add"].run({"a": 1, "b": 1}).text == "2"


def test_a_hanging_tool_times_out_and_the_next_call_works(tools) -> None:
    before = tools["pid"].run({}).text
    start = time.monotonic()
    assert tools["hang"].run({}) == ToolResult("error: tool hang timed out after 0.5 s", False)
    assert time.monotonic() - start < 1.5
    assert tools["add"].run({"a": 1, "b": 2}).text == "3"
    assert tools["pid"].run({}).text != before  # the killed worker was replaced


def test_stdout_writes_do_not_corrupt_the_protocol(tools) -> None:
    assert tools["chatty"].run({}).text == "quiet answer"
    assert tools["add"].run({"a": 3, "b": 4}).text == "7"


def test_large_results_are_cut(tools) -> None:
    result = tools["huge"].run({})
    assert result.ok and result.text.endswith(" ...(truncated)")
    assert len(result.text.encode()) <= 4096 and result.text.startswith("xxxx")


def test_a_dying_worker_is_an_error_then_restarts(tools) -> None:
    result = tools["crash"].run({})
    assert not result.ok and "crashed" in result.text and "code 3" in result.text
    assert tools["add"].run({"a": 5, "b": 5}).text == "10"


def test_close_stops_the_worker(tools_file: Path) -> None:
    worker = ToolWorker(tools_file, timeout_s=0.5)
    pid = int(worker.call("pid", {}).text)
    worker.close()
    worker.close()  # twice is fine
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert worker.call("add", {"a": 1, "b": 1}).text == "2"  # and a closed worker starts again on demand
    worker.close()


BAD_MODULES = [
    ("def add(a, b: int) -> int:\n    '''Add.'''\n    return a + b\n",
     "tool add, parameter a: no type hint; annotate it (str, int, float, bool, list[...], Literal[...])"),
    ("def add(*numbers: int) -> int:\n    '''Add.'''\n    return sum(numbers)\n", "tool add, parameter numbers: *numbers"),
    ("def add(a: int, **more: int) -> int:\n    '''Add.'''\n    return a\n", "tool add, parameter more: **more"),
    ("def add(a: dict[str, int]) -> int:\n    '''Add.'''\n    return 0\n",
     "tool add, parameter a: unsupported type hint dict[str, int]"),
    ("def add(a: int | str) -> int:\n    '''Add.'''\n    return 0\n", "tool add, parameter a: unsupported type hint"),
    ("def add(a: list) -> int:\n    '''Add.'''\n    return 0\n", "tool add, parameter a: unsupported type hint list"),
    ("def add(a: int) -> int:\n    return a\n", "tool add: no docstring"),
    ("from os.path import join\n\ndef _private(a: int) -> int:\n    '''No.'''\n    return a\n", "no public function"),
    ("def add(a: int) -> int\n    return a\n", "importing it failed: SyntaxError"),
    ("raise RuntimeError('no database here\\nreally none')\n", "importing it failed: RuntimeError: really none"),
    ("import sys\nsys.exit(4)\n", "importing it failed: SystemExit: 4"),
]


@pytest.mark.parametrize(("source", "expected"), BAD_MODULES)
def test_bad_modules_are_one_line(tmp_path: Path, source: str, expected: str) -> None:
    path = tmp_path / "my_tools.py"
    path.write_text(textwrap.dedent(source))
    with pytest.raises(TaskFileError) as info:
        load_tool_specs(path)
    message = str(info.value)
    assert isinstance(info.value, UserError) and info.value.exit_code == 2
    assert "\n" not in message and message.startswith(f"{path}: ") and expected in message, message


def test_a_module_that_kills_its_importer_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "my_tools.py"
    path.write_text("import os, sys\nsys.stderr.write('dying now\\n')\nos._exit(9)\n")
    with pytest.raises(TaskFileError, match=r"could not be loaded \(worker exited with code 9: dying now\)"):
        load_tool_specs(path)


def test_a_slow_import_times_out(tmp_path: Path) -> None:
    path = tmp_path / "my_tools.py"
    path.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(TaskFileError, match="took over 0.5 s"):
        load_tool_specs(path, timeout_s=0.5)


def test_a_missing_tools_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(TaskFileError, match="no such tools file"):
        load_tool_specs(tmp_path / "absent.py")

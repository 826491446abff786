"""Tools from a user's Python module: typed, documented functions become `Tool`s.

The module is imported only in child processes (`tool_worker`), never here: a
user function that crashes, hangs, prints or eats memory must not be able to
take the training run with it. `load_tool_specs` runs the child once to read
each public function's name, description and parameter schema; a `ToolWorker`
then serves every call of one module from one persistent child, started on the
first call, killed when a call runs past its budget and restarted on the next.
Note the module is imported once per child, so its import-time side effects run
more than once.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miniverl.engine.tasks.base import Tool, ToolResult
from miniverl.engine.tasks.task_files import TaskFileError, read_task_file

DEFAULT_TIMEOUT_S = 5.0  # per call
DEFAULT_MEMORY_BYTES = 1 << 30  # the worker's address-space cap
DEFAULT_MAX_BYTES = 4096  # of UTF-8 result text
DESCRIBE_TIMEOUT_S = 30.0  # importing the module (a heavy import such as numpy is slow on a cold cache)
_WORKER_MODULE = "miniverl.engine.tasks.tool_worker"


@dataclass(frozen=True)
class ToolSpecInfo:
    """One tool as the model sees it: a name, a description and a JSON schema of its parameters."""

    name: str
    description: str
    parameters: dict[str, Any]


def worker_command(path: Path, memory_bytes: int, describe: bool = False) -> list[str]:
    return [sys.executable, "-m", _WORKER_MODULE, *(["--describe"] if describe else []),
            "--memory-bytes", str(memory_bytes), str(path)]


def load_tool_specs(path: Path, *, timeout_s: float = DESCRIBE_TIMEOUT_S,
                    memory_bytes: int = DEFAULT_MEMORY_BYTES) -> list[ToolSpecInfo]:
    """The module's tools, read by importing it in a child; TaskFileError (one line) on any problem."""
    read_task_file(path, "tools file")
    with tempfile.TemporaryFile() as stderr:
        try:
            done = subprocess.run(worker_command(path, memory_bytes, describe=True), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=stderr, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise TaskFileError(f"{path}: importing the tools module took over {timeout_s:g} s; "
                                "move slow work out of import time") from None
        reply = _last_json_line(done.stdout)
        if reply is None:
            why = _tail_line(stderr)
            raise TaskFileError(f"{path}: the tools module could not be loaded (worker exited with code "
                                f"{done.returncode}{': ' + why if why else ''})")
    if "error" in reply:
        raise TaskFileError(str(reply["error"]))
    return [ToolSpecInfo(s["name"], s["description"], s["parameters"]) for s in reply["specs"]]


class ToolWorker:
    """One child process serving every tool of one module; `call` never raises."""

    def __init__(self, path: Path, *, timeout_s: float = DEFAULT_TIMEOUT_S, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 max_bytes: int = DEFAULT_MAX_BYTES, startup_timeout_s: float = DESCRIBE_TIMEOUT_S) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.max_bytes = max_bytes
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # one request in flight: the protocol is a single pipe pair

    def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        with self._lock:
            try:
                return self._call(name, arguments)
            except Exception as exc:  # noqa: BLE001 - a tool must never crash the run; start afresh next call
                self._kill()
                return ToolResult(f"error: tool {name} failed: {type(exc).__name__}: {exc}", False)

    def close(self) -> None:
        """Stop the worker (an idle one exits on end of input; a busy one is killed). Safe to call twice."""
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is None:
                return
            try:
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(timeout=1)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
            _close_pipes(proc)

    def _call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            problem = self._start()
            if problem is not None:
                return ToolResult(f"error: tool {name} could not start: {problem}", False)
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        request = json.dumps({"name": name, "arguments": arguments, "max_bytes": self.max_bytes}).encode() + b"\n"
        try:
            _write_all(proc.stdin.fileno(), request)
        except OSError:
            return self._crashed(name)
        line, why = self._read_line(self.timeout_s)
        if why == "timeout":
            self._kill()
            return ToolResult(f"error: tool {name} timed out after {self.timeout_s:g} s", False)
        if why == "too long":
            self._kill()
            return ToolResult(f"error: tool {name} wrote an oversized reply to the worker protocol", False)
        if line is None:
            return self._crashed(name)
        reply = json.loads(line)
        return ToolResult(str(reply["text"]), bool(reply["ok"]))

    def _start(self) -> str | None:
        """Start the child and wait until it has imported the module; why not, or None."""
        self._proc = subprocess.Popen(worker_command(self.path, self.memory_bytes), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
        line, why = self._read_line(self.startup_timeout_s)
        reply = json.loads(line) if line is not None else {}
        if reply.get("ready") is True:
            return None
        self._kill()
        if why == "timeout":
            return f"importing {self.path} took over {self.startup_timeout_s:g} s"
        return str(reply.get("error") or "the worker exited while importing the module")

    def _read_line(self, timeout_s: float) -> tuple[bytes | None, str | None]:
        """One reply line within `timeout_s`, or (None, "timeout" | "eof" | "too long")."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        # A reply is the capped text JSON-escaped (at most 6 bytes per byte) plus its envelope.
        limit = 6 * self.max_bytes + 4096
        buffer = bytearray()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None, "timeout"
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return None, "eof"
            buffer += chunk
            if len(buffer) > limit:
                return None, "too long"
        return bytes(buffer.split(b"\n", 1)[0]), None

    def _crashed(self, name: str) -> ToolResult:
        proc = self._proc
        try:
            code = proc.wait(timeout=1) if proc is not None else None  # the pipe closes just before the exit is reaped
        except subprocess.TimeoutExpired:
            code = None
        self._kill()
        detail = f" (worker exited with code {code})" if code is not None else ""
        return ToolResult(f"error: tool {name} crashed{detail}; it restarts on the next call", False)

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        _close_pipes(proc)


class UserTool(Tool):
    """One function of a user's module, run by the module's shared `ToolWorker`."""

    def __init__(self, spec: ToolSpecInfo, worker: ToolWorker) -> None:
        self.name = spec.name
        self.description = spec.description
        self.parameters = spec.parameters
        self.worker = worker

    def run(self, arguments: dict[str, Any]) -> ToolResult:
        return self.worker.call(self.name, arguments)

    def close(self) -> None:
        self.worker.close()


def load_user_tools(path: Path, *, timeout_s: float = DEFAULT_TIMEOUT_S, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                    max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[UserTool, ...]:
    """Every tool of the module, sharing one worker (not started until the first call)."""
    specs = load_tool_specs(path, memory_bytes=memory_bytes)
    worker = ToolWorker(path, timeout_s=timeout_s, memory_bytes=memory_bytes, max_bytes=max_bytes)
    return tuple(UserTool(spec, worker) for spec in specs)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass


def _last_json_line(data: bytes) -> dict[str, Any] | None:
    lines = [line for line in data.splitlines() if line.strip()]
    try:
        reply = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return reply if isinstance(reply, dict) and ("error" in reply or "specs" in reply) else None


def _tail_line(stream: Any) -> str:
    """The last non-empty line of what the child wrote to stderr, kept short."""
    stream.seek(0, os.SEEK_END)
    stream.seek(max(0, stream.tell() - 2048))
    lines = [line.strip() for line in stream.read().decode("utf-8", errors="replace").splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""

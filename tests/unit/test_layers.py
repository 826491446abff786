"""The layer contract: which part of the tree may import which, and no import cycles.

    cli -> report | checks | export -> run -> stages | tiny -> rollout -> distill | models | tasks -> core

A module may import its own package and any package of a lower layer; packages
that share a layer are independent of each other. Every import counts, also
those inside functions (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

from support import ROOT

LAYERS: list[tuple[str, ...]] = [
    ("cli",),
    ("report", "checks", "export"),
    ("run",),
    ("stages", "tiny"),
    ("rollout",),
    ("distill", "models", "tasks"),
    ("core",),
]
RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}


def package_of(module: str) -> str | None:
    """`miniverl.engine.core.recipe` -> `core`; `miniverl.stages.rollout` -> `stages`."""
    parts = module.split(".")
    if parts[:2] == ["miniverl", "stages"]:
        return "stages"
    if parts[:2] == ["miniverl", "engine"] and len(parts) > 2:
        return parts[2]
    return None


def module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    top, *rest = relative.parts
    return ".".join(["miniverl", top, *rest]).removesuffix(".__init__")


def imports_of(source: str) -> list[tuple[int, str]]:
    """(line, imported module) for every miniverl import in the source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"line {node.lineno}: relative import; the tree uses absolute imports"
            # `from miniverl.engine.core import recipe` imports the module core.recipe
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
            found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name.startswith("miniverl.")]


def violations(module: str, source: str) -> list[str]:
    own = package_of(module)
    problems = []
    for line, target in imports_of(source):
        other = package_of(target)
        if own is None or other is None or other == own:
            continue
        if other not in RANK:
            problems.append(f"{module}:{line} imports {target}: package {other!r} has no layer")
        elif RANK[other] <= RANK[own]:
            problems.append(f"{module}:{line} imports {target}: {own} may not import {other} (same or higher layer)")
    return problems


def source_files() -> list[Path]:
    return sorted(p for folder in ("engine", "stages") for p in (ROOT / folder).rglob("*.py"))


def test_every_package_has_a_layer() -> None:
    packages = {package_of(module_name(p)) for p in source_files()} - {None}
    assert packages <= set(RANK), f"packages without a layer: {sorted(packages - set(RANK))}"


def test_no_module_imports_a_higher_layer() -> None:
    problems = [v for p in source_files() for v in violations(module_name(p), p.read_text())]
    assert problems == []


def test_the_check_catches_an_upward_import() -> None:
    """A deliberate bad import: the core may not reach up into the driver."""
    bad = "import torch\n\ndef helper():\n    from miniverl.engine.run.driver import Driver\n"
    assert violations("miniverl.engine.core.recipe", bad) == [
        "miniverl.engine.core.recipe:4 imports miniverl.engine.run.driver.Driver: core may not import run "
        "(same or higher layer)",
        "miniverl.engine.core.recipe:4 imports miniverl.engine.run.driver: core may not import run "
        "(same or higher layer)",
    ]
    # Siblings in one layer are independent too.
    assert violations("miniverl.engine.models.host", "from miniverl.engine.tasks.calculator import judge\n")


def test_no_import_cycles() -> None:
    modules = {module_name(p): p for p in source_files()}
    graph = {m: {t for _, t in imports_of(p.read_text()) if t in modules and t != m} for m, p in modules.items()}
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(module: str, trail: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return trail + [module, target]
            if target not in state and (cycle := visit(target, trail + [module])):
                return cycle
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [])
            assert cycle is None, "import cycle: " + " -> ".join(cycle[cycle.index(cycle[-1]):])

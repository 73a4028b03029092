"""The import levels of docs/architecture.md, read from the source (no import is executed).

Each package may import the packages its level allows, and itself; the packages' import graph
has no cycle (imports under ``if TYPE_CHECKING:`` do not count: they never run). Lower levels
never reach higher ones; the engine reaches the model side only through the executor; the
server, benchmarks, CLI and the LLM class see the public engine API only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tokenmill

ROOT = Path(tokenmill.__file__).parent
# Level 1: data and configuration, stdlib (and tokenizers / jinja for the tokenizer) only.
LEVEL1 = {
    *("config", "cost", "kv_layout", "modelfile", "request", "sampling_params", "outputs"),
    *("architectures", "embedded", "memory", "pooling", "reasoning", "resolve", "store"),
    *("catalog", "recipes", "tokenizer", "pages", "harmony"),
}
# Level 3: torch building blocks; they may use each other.
# (_qgemm is the C extension built from tokenmill/csrc, loaded by the kernels package.)
LEVEL3 = {"kernels", "layers", "attention", "quant", "moe", "spec", "structured", "_qgemm"}
PUBLIC_ENGINE = LEVEL1 | {"engine"}
ALLOWED: dict[str, set[str]] = {
    **{name: LEVEL1 for name in LEVEL1},
    "core": LEVEL1,
    **{name: LEVEL1 | LEVEL3 for name in LEVEL3},
    "models": LEVEL1 | LEVEL3,
    # core.block_pool: a draft model's own KV blocks (worker/draft_proposer.py).
    "worker": LEVEL1 | LEVEL3 | {"models", "core.sched_output", "core.block_pool"},
    "executor": LEVEL1 | {"worker", "core.sched_output"},
    # structured.compiler: formats compiled where requests are prepared (it has no torch).
    "engine": LEVEL1 | {"core", "executor", "structured.compiler"},
    "entrypoints": PUBLIC_ENGINE,
    # kernels.probe: the planner's hardware probes time the engine's own kernels.
    "bench": PUBLIC_ENGINE | {"entrypoints", "kernels.probe"},
    "server": PUBLIC_ENGINE,
    # The router is a light process in front of servers: level 1 only, no engine, no torch.
    "router": LEVEL1,
    # The host of many models is a light process too: it runs them as `serve` subprocesses.
    "host": LEVEL1 | {"router"},
    "cli": PUBLIC_ENGINE | {"server", "bench", "entrypoints", "router", "host"},
}
NO_TORCH = LEVEL1 | {"core", "executor", "engine", "router", "host"}
# Modules of torch packages that torch-free ones import (their package's __init__ included).
NO_TORCH_MODULES = {"structured/__init__.py", "structured/compiler.py"}
TORCH_LIKE = ("torch", "numpy", "transformers", "triton")


def package_of(path: Path) -> str:
    """tokenmill/worker/sampler.py -> "worker"; tokenmill/cli.py -> "cli"."""
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def runtime_imports(path: Path) -> set[str]:
    """Modules a file imports when it runs (anywhere in it, but not under TYPE_CHECKING)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "tokenmill":  # from tokenmill import kernels (not __version__)
                names.update(f"tokenmill.{a.name}" for a in node.names if a.name[:2] != "__")
            else:
                names.add(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return names


def package_files() -> list[Path]:
    # tokenmill/__init__.py is the public face: it re-exports LLM lazily, from the top level.
    return [p for p in sorted(ROOT.rglob("*.py")) if p != ROOT / "__init__.py"]


def allowed(package: str, module: str) -> bool:
    parts = module.split(".")[1:]
    if not parts or parts[0] == package:
        return True
    rules = ALLOWED[package]
    return parts[0] in rules or ".".join(parts[:2]) in rules


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_imports_only_what_its_level_allows(path: Path) -> None:
    package = package_of(path)
    assert package in ALLOWED, f"{package} has no level: add it to docs/architecture.md and here"
    for module in runtime_imports(path):
        top = module.split(".")[0]
        if top == "tokenmill":
            assert allowed(package, module), f"{package} may not import {module}"
        elif package in NO_TORCH or str(path.relative_to(ROOT)) in NO_TORCH_MODULES:
            assert top not in TORCH_LIKE, f"{path.relative_to(ROOT)} must not import {module}"


def test_packages_import_each_other_without_cycles() -> None:
    edges: dict[str, set[str]] = {}
    for path in package_files():
        package = package_of(path)
        for module in runtime_imports(path):
            parts = module.split(".")
            if parts[0] == "tokenmill" and len(parts) > 1 and parts[1] != package:
                edges.setdefault(package, set()).add(parts[1])

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(p for p in edges if reaches(p, p, {p}))
    assert not cycles, f"packages in an import cycle: {cycles}"

"""core/ imports only level-1 modules (config, request, sampling_params, outputs) and itself:
no torch, no models, worker or engine (ARCHITECTURE.md, "Boundaries")."""

from __future__ import annotations

import ast
from pathlib import Path

import tokenmill.core

ALLOWED_TOKENMILL = {
    "tokenmill.config",
    "tokenmill.request",
    "tokenmill.sampling_params",
    "tokenmill.outputs",
}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_core_modules_import_no_torch_and_no_higher_level():
    core_dir = Path(tokenmill.core.__file__).parent
    files = sorted(core_dir.glob("*.py"))
    assert {f.name for f in files} >= {"block_pool.py", "kv_cache_manager.py", "scheduler.py"}
    for path in files:
        for name in imported_modules(path):
            top = name.split(".")[0]
            if top != "tokenmill":
                assert top not in ("torch", "numpy", "transformers"), (path.name, name)
                continue
            assert name.startswith("tokenmill.core") or name in ALLOWED_TOKENMILL, (path.name, name)

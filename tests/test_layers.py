"""Imports point one way: core (routing, predictors, config) <- backends, replay <- gateway.
Parsed with ast, so a lazy import inside a function counts as much as a top-level one."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYER = {"config": 0, "routing": 0, "predictors": 0, "backends": 1, "replay": 1, "gateway": 2}
# `bench` is not part of the product (not installed; run from a checkout): nothing imports it.
ALLOWED: set[tuple[str, str]] = set()


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
    return out


def test_no_import_runs_up_the_layers() -> None:
    bad = []
    for pkg, rank in LAYER.items():
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for line, module in _imports(path):
                top = module.split(".")[0]
                above = LAYER.get(top, 3 if top == "bench" else -1) > rank
                if above and (rel, module) not in ALLOWED:
                    bad.append(f"{rel}:{line} imports {module}")
    assert bad == []

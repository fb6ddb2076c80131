"""The tree's size rules: no class over 350 lines and no function over 80 in the service's
code (``streamxm/``, ``api/``, ``workers/``), counted from the ``def`` or ``class`` line to the
last line, docstring included. A model's math may live in module functions beside its class."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMITS = {ast.ClassDef: 350, ast.FunctionDef: 80, ast.AsyncFunctionDef: 80}


def test_no_class_over_350_lines_and_no_function_over_80() -> None:
    over = []
    for package in ("streamxm", "api", "workers"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                limit = LIMITS.get(type(node))
                if limit is None:
                    continue
                assert isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    over.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {lines}")
    assert not over, over

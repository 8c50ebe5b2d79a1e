"""The shape the code keeps for the people who carry it on: no function over 100 lines, no class over 400."""

from __future__ import annotations

import ast
from pathlib import Path

import memfit

SOURCE = Path(memfit.__file__).resolve().parent
MOST_FUNCTION_LINES, MOST_CLASS_LINES = 100, 400


def test_no_function_over_100_lines_and_no_class_over_400() -> None:
    too_long = []
    for path in sorted(SOURCE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            most = MOST_CLASS_LINES if isinstance(node, ast.ClassDef) else MOST_FUNCTION_LINES
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > most:
                    too_long.append(f"{path.relative_to(SOURCE)}:{node.name} ({lines} lines)")
    assert not too_long, too_long

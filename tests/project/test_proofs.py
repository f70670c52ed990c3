"""Rules on the suite's own proofs: every function that compares greedy tokens with a reference also runs the
negative control (wrong input's answer must fail the same comparison)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _called(node: ast.AST) -> set[str]:
    names = set()
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        func = call.func
        names.add(func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else "")
    return names


def uncontrolled(source: str, path: str = "<source>") -> list[str]:
    """The top-level functions of `source` that call assert_greedy_agree without assert_greedy_differ."""
    tree = ast.parse(source, filename=path)
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    return [
        f"{path}:{f.lineno} {f.name}"
        for f in functions
        if "assert_greedy_agree" in (called := _called(f)) and "assert_greedy_differ" not in called
    ]


def test_every_greedy_comparison_runs_its_negative_control() -> None:
    files = [p for p in (ROOT / "tests").rglob("*.py")]
    missing = [m for p in files for m in uncontrolled(p.read_text(), str(p.relative_to(ROOT)))]
    assert not missing, f"greedy comparisons without a negative control (assert_greedy_differ): {missing}"


def test_the_rule_sees_a_comparison_without_its_control() -> None:
    bare = "def test_a(x):\n    assert_greedy_agree(x, x, 1e-3)\n"
    controlled = bare + "    exactness.assert_greedy_differ(x, x, 1e-3)\n"
    assert uncontrolled(bare) == ["<source>:1 test_a"] and uncontrolled(controlled) == []

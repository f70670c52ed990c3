"""The project's own rules, checked on its source: every module says its role, every CLI flag has help text, and
every module stays small; ruff formats and lints it all."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("eric_epd", "router")
EVERYWHERE = (*LIBRARY, "benchmarks", "scripts", "tests")
MAX_LINES = 400


def _modules(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if ".venv" not in p.parts)


def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@pytest.mark.parametrize("folder", EVERYWHERE)
def test_every_module_opens_with_its_role(folder: str) -> None:
    missing = [
        str(p.relative_to(ROOT)) for p in _modules(folder) if p.stat().st_size and ast.get_docstring(_parsed(p)) is None
    ]
    assert not missing, f"modules without a docstring: {missing}"


@pytest.mark.parametrize("folder", EVERYWHERE)
def test_every_cli_flag_has_help(folder: str) -> None:
    bare = []
    for path in _modules(folder):
        for node in ast.walk(_parsed(path)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"
                and not any(k.arg == "help" for k in node.keywords)
            ):
                names = [a.value for a in node.args if isinstance(a, ast.Constant)]
                bare.append(f"{path.relative_to(ROOT)}:{node.lineno} {names}")
    assert not bare, f"flags without help text: {bare}"


def test_every_module_stays_small() -> None:
    """Every Python file of the project (library, tests, benchmarks, scripts, examples...; not .venv or other hidden
    folders) stays within MAX_LINES."""
    folders = [p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")]
    long = {
        str(p.relative_to(ROOT)): n
        for p in [*ROOT.glob("*.py"), *_modules(*folders)]
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("command", [("format", "--check"), ("check",)])
def test_ruff_formats_and_passes_every_file(command: tuple[str, ...]) -> None:
    """The formatter leaves every file as it is (lines of at most 120 characters), and the linter finds nothing."""
    done = subprocess.run([sys.executable, "-m", "ruff", *command, str(ROOT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr

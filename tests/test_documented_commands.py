"""Every `eric-epd serve`, `epd-gateway` and `vllm serve` line in README.md, examples/ and the plugin READMEs,
extracted (continuation lines joined, environment assignments and shell variables filled in) and parsed by the
real parsers, with consistency checks: an advertised address needs a non-loopback bind, a hub id parses as one."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from eric_epd.cli import _check_reachable, _serve_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "examples").glob("*.md")),
        *sorted(ROOT.glob("eric_epd/plugins/*/README.md"))]
VARS = {"ERIC_API_KEY": "k1", "ENGINE_KEY": "k2", "CLIENT_KEY": "k3", "ADMIN_KEY": "k4", "ERIC_KEY": "k1",
        "HOST_IP": "10.0.1.1", "EC": "{}"}


def _balanced(line: str) -> bool:
    try:
        shlex.split(line)
    except ValueError:
        return False
    return True


def _commands(program: str) -> list[tuple[str, list[str]]]:
    """(where, argv after the program) for each documented command line of `program`."""
    found = []
    for doc in DOCS:
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", doc.read_text(), flags=re.S):
            lines = block.splitlines()
            i = 0
            while i < len(lines):
                line = lines[i]
                while (line.rstrip().endswith("\\") or not _balanced(line)) and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip().removesuffix("\\") + " " + lines[i].strip()
                i += 1
                text = line.split(" #")[0].strip().replace(".venv/bin/", "")
                if not re.search(rf"(^|\s){re.escape(program)}\s", text + " ") or text.startswith("#"):
                    continue
                for name, value in VARS.items():
                    text = text.replace(f"${name}", value).replace(f"${{{name}}}", value)
                text = re.sub(r"\$\(\((\d+) << (\d+)\)\)", lambda m: str(int(m[1]) << int(m[2])), text)
                words = shlex.split(text)
                n = len(program.split())
                start = next(k for k in range(len(words)) if " ".join(words[k:k + n]) == program)
                found.append((f"{doc.relative_to(ROOT)}: {text[:60]}", words[start + n:]))
    return found


def test_eric_command_lines_parse_and_are_reachable(qwen2_vl_tiny: Path) -> None:
    """Parsed, checked (an advertised host behind a loopback bind is a SystemExit) and turned into a valid config
    (the documented checkpoint swapped for the local tiny one: nothing is downloaded here)."""
    from eric_epd.cli import config_from_args

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    commands = _commands("eric-epd serve")
    assert len(commands) >= 4
    for where, argv in commands:
        args = parser.parse_args(["serve", *argv])
        _check_reachable(args.host, args.advertise_host)
        args.model, args.revision = str(qwen2_vl_tiny), None
        assert config_from_args(args).tp_size >= 1, where


def test_gateway_command_lines_parse() -> None:
    from epd_gateway.config import parse_args

    commands = _commands("epd-gateway")
    assert len(commands) >= 2
    for where, argv in commands:
        config = parse_args(argv)
        assert config is not None, where


def test_vllm_serve_lines_parse() -> None:
    """vLLM's own `serve` parser accepts every documented flag (its plugins' JSON configs included)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers())
    commands = _commands("vllm serve")
    assert len(commands) >= 2
    for where, argv in commands:
        args = parser.parse_args(["serve", *argv])
        assert args.model_tag or args.model, where

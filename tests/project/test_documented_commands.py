"""Every `eric-epd serve`, `epd-gateway` and `vllm serve` line in README.md, examples/, docs/ and the plugin READMEs,
extracted (continuation lines joined, environment assignments and shell variables filled in) and parsed by the
real parsers, with consistency checks: an advertised address needs a non-loopback bind, a hub id parses as one,
each tensor-parallel size fits the GPUs its line makes visible (Eric and engines on disjoint GPUs), and every vLLM
connector names a transport the document's Erics serve (Mooncake over the same protocol)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from eric_epd.eric.cli import _check_reachable
from eric_epd.eric.cli import add_parser as _serve_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "examples").glob("*.md")),
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted(ROOT.glob("eric_epd/plugins/*/README.md")),
]
VARS = {
    "ERIC_API_KEY": "k1",
    "ENGINE_KEY": "k2",
    "CLIENT_KEY": "k3",
    "ADMIN_KEY": "k4",
    "ERIC_KEY": "k1",
    "HOST_IP": "10.0.1.1",
}


def _balanced(line: str) -> bool:
    try:
        shlex.split(line)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Command:
    doc: str
    where: str
    env: dict[str, str]
    argv: list[str]
    """The words after the program name."""


def _documented(program: str) -> list[Command]:
    """Each documented command line of `program`, with the environment assignments written before it."""
    found = []
    for doc in DOCS:
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", doc.read_text(), flags=re.S):
            lines = block.splitlines()
            assigned: dict[str, str] = {}
            i = 0
            while i < len(lines):
                line = lines[i]
                while (line.rstrip().endswith("\\") or not _balanced(line)) and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip().removesuffix("\\") + " " + lines[i].strip()
                i += 1
                text = line.split(" #")[0].strip().replace(".venv/bin/", "")
                for name, value in (VARS | assigned).items():
                    text = text.replace(f'"${name}"', shlex.quote(value))
                if re.match(r"^[A-Z_]+='", text):  # a shell variable the block's later lines use
                    name, value = shlex.split(text)[0].split("=", 1)
                    assigned[name] = value
                    continue
                if not re.search(rf"(^|\s){re.escape(program)}\s", text + " ") or text.startswith("#"):
                    continue
                for name, value in VARS.items():
                    text = text.replace(f"${name}", value).replace(f"${{{name}}}", value)
                text = re.sub(r"\$\(\((\d+) << (\d+)\)\)", lambda m: str(int(m[1]) << int(m[2])), text)
                words = shlex.split(text)
                n = len(program.split())
                start = next(k for k in range(len(words)) if " ".join(words[k : k + n]) == program)
                env = dict(w.split("=", 1) for w in words[:start] if re.match(r"^[A-Z_]+=", w))
                found.append(
                    Command(
                        str(doc.relative_to(ROOT)), f"{doc.relative_to(ROOT)}: {text[:60]}", env, words[start + n :]
                    )
                )
    return found


def _commands(program: str) -> list[tuple[str, list[str]]]:
    return [(c.where, c.argv) for c in _documented(program)]


def test_eric_command_lines_parse_and_are_reachable(qwen2_vl_tiny: Path) -> None:
    """Parsed, checked (an advertised host behind a loopback bind is a SystemExit) and turned into a valid config
    (the documented checkpoint swapped for the local tiny one: nothing is downloaded here)."""
    from eric_epd.eric.cli import config_from_args

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    commands = _commands("eric-epd serve")
    assert len(commands) >= 4
    for where, argv in commands:
        args = parser.parse_args(["serve", *argv])
        _check_reachable(args.host, args.advertise_host)
        args.model, args.revision = str(qwen2_vl_tiny), None
        assert config_from_args(args).tp_size >= 1, where


def test_profile_plan_and_up_lines_parse() -> None:
    """`eric-epd profile`, `plan` and `up` lines parse with the real `eric-epd` parser."""
    from eric_epd.cli import build_parser

    parser = build_parser()
    for program, least in (("eric-epd profile", 2), ("eric-epd plan", 1), ("eric-epd up", 2)):
        commands = _commands(program)
        assert len(commands) >= least, program
        for where, argv in commands:
            args = parser.parse_args([program.split()[1], *argv])
            assert args.command == program.split()[1], where


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


def _gpus(command: Command) -> set[str] | None:
    visible = command.env.get("CUDA_VISIBLE_DEVICES")
    return None if visible is None else {d for d in visible.split(",") if d}


def _vllm_args(argv: list[str]) -> argparse.Namespace:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def _eric_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_tensor_parallel_sizes_fit_the_visible_gpus() -> None:
    """A line that sets CUDA_VISIBLE_DEVICES makes at least as many GPUs visible as its TP size, and an Eric and an
    engine of one document never share a GPU."""
    checked = 0
    erics = [(c, _eric_args(c.argv).tp) for c in _documented("eric-epd serve")]
    engines = [(c, _vllm_args(c.argv).tensor_parallel_size) for c in _documented("vllm serve")]
    for command, tp in erics + engines:
        gpus = _gpus(command)
        if gpus is not None:
            checked += 1
            assert len(gpus) >= tp, f"{command.where}: TP {tp} on {len(gpus)} visible GPUs"
    for eric, _ in erics:
        for engine, _ in engines:
            if eric.doc == engine.doc and _gpus(eric) is not None and _gpus(engine) is not None:
                assert not _gpus(eric) & _gpus(engine), f"{eric.where} and {engine.where} share GPUs"
    assert checked >= 2  # docs/deploy-gpu.md places Eric and vLLM on their GPUs


def _connector(argv: list[str]) -> dict | None:
    config = _vllm_args(argv).ec_transfer_config
    if config is None:
        return None
    if isinstance(config, str):
        return json.loads(config)
    return {"ec_connector": config.ec_connector, "ec_connector_extra_config": config.ec_connector_extra_config}


def test_every_documented_connector_names_a_transport_its_erics_serve() -> None:
    """Backends named on both sides: a vLLM connector's list (beyond the HTTP fallback) meets what the document's
    Erics serve, and a Mooncake consumer speaks the Erics' Mooncake protocol."""
    from eric_epd.wire.handles import BACKENDS

    served: dict[str, set[str]] = {}
    protocols: dict[str, set[str]] = {}
    for c in _documented("eric-epd serve"):
        args = _eric_args(c.argv)
        served.setdefault(c.doc, set()).update(b for b in args.transfer_backends.split(",") if b)
        protocols.setdefault(c.doc, set()).add(args.mooncake_protocol)
    checked = 0
    for c in _documented("vllm serve"):
        config = _connector(c.argv)
        if config is None or config.get("ec_connector") != "EricECConnector":
            continue
        extra = config.get("ec_connector_extra_config") or {}
        wanted = set(extra.get("backends", BACKENDS)) - {"http"}
        assert c.doc in served, f"{c.where}: no Eric line in the same document"
        assert wanted & served[c.doc], f"{c.where}: names {sorted(wanted)}, the Erics serve {sorted(served[c.doc])}"
        if "mooncake" in wanted & served[c.doc]:
            assert extra.get("mooncake_protocol", "tcp") in protocols[c.doc], f"{c.where}: Mooncake protocol"
        checked += 1
    assert checked >= 3

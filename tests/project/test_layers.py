"""The layers of the project, checked on its source (every import, lazy ones inside functions included, followed
transitively: a module's rule holds for everything importing it runs): no import circle, no arrow from a lower layer
up (nor up the ladder of layers), the gateway on the shared wire only, no production code on the test kit; and
Eric's router reads the checkpoint's config.json once."""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOWER = ("common", "media", "wire", "models", "transfer", "runtime")
"""What every server and plugin stands on; none of it knows who stands on it."""
UPPER = ("eric", "geri", "plugins", "stack", "testing", "checkpoints", "planning")
GATEWAY_MAY_USE = ("common", "media", "wire")
LADDER: tuple[tuple[str, ...], ...] = (
    ("common",),
    ("media",),
    ("wire",),
    ("models", "transfer"),
    ("runtime",),
    ("checkpoints", "planning"),
    ("eric", "geri", "plugins"),
    ("stack",),
    ("testing",),
    ("cli",),
    ("__main__",),
)
"""eric_epd's layers bottom up: a module reaches its own layer and the rungs below it, never a layer beside it on
its rung or above it (the package's own __init__, its __version__, is below them all)."""


def _module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """The project modules `path` imports: `from a.b import c` is a.b.c where that is a module, a.b otherwise."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}".rstrip(".")
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {name for name in out if name.split(".")[0] in ("eric_epd", "epd_gateway")}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p, ROOT): p for p in (ROOT / "eric_epd").rglob("*.py")}
    files.update({_module_name(p, ROOT / "router"): p for p in (ROOT / "router" / "epd_gateway").rglob("*.py")})
    known = set(files)
    return {name: _imports(path, name, known) for name, path in files.items()}


GRAPH = _graph()


def _layer(module: str) -> str:
    return module.split(".")[1] if module.startswith("eric_epd.") else ""


def _reach(graph: dict[str, set[str]], module: str) -> dict[str, str]:
    """Every module importing `module` runs, each by the module that first imports it (breadth first, so a path read
    back is a shortest one): what `module` imports, directly or through others, lazily or not, and the packages
    above each (importing a.b.c runs a's and a.b's __init__ first)."""
    by: dict[str, str] = {module: ""}
    queue = deque([module])
    while queue:
        node = queue.popleft()
        parts = node.split(".")
        packages = {".".join(parts[:i]) for i in range(1, len(parts))} & graph.keys()
        for nxt in sorted(graph.get(node, set()) | packages):
            if nxt not in by:
                by[nxt] = node
                queue.append(nxt)
    return by


def _path(by: dict[str, str], target: str) -> str:
    steps = [target]
    while by[steps[-1]]:
        steps.append(by[steps[-1]])
    return " -> ".join(reversed(steps))


def _arrows(
    graph: dict[str, set[str]], source: Callable[[str], bool], may_reach: Callable[[str, str], bool]
) -> list[str]:
    """For each `source` module, the path to every module it reaches (see _reach) and may not."""
    return [
        _path(by, target)
        for module in sorted(filter(source, graph))
        for by in [_reach(graph, module)]
        for target in sorted(by)
        if target != module and not may_reach(module, target)
    ]


def _climbing_from_lower(graph: dict[str, set[str]]) -> list[str]:
    return _arrows(
        graph, lambda m: _layer(m) in LOWER, lambda m, t: _layer(t) not in UPPER and not t.startswith("epd_gateway")
    )


def _rung(layer: str) -> int:
    return next((i for i, rung in enumerate(LADDER) if layer in rung), -1)


def _up_the_ladder(graph: dict[str, set[str]]) -> list[str]:
    def may_reach(module: str, target: str) -> bool:
        if target == "eric_epd" or _layer(target) == _layer(module):
            return True
        return target.startswith("eric_epd.") and _rung(_layer(target)) < _rung(_layer(module))

    return _arrows(graph, lambda m: m.startswith("eric_epd."), may_reach)


def _gateway_beyond_the_wire(graph: dict[str, set[str]]) -> list[str]:
    return _arrows(
        graph,
        lambda m: m.startswith("epd_gateway"),
        lambda m, t: t.startswith("epd_gateway") or t == "eric_epd" or _layer(t) in GATEWAY_MAY_USE,
    )


def _on_the_test_kit(graph: dict[str, set[str]]) -> list[str]:
    return _arrows(
        graph, lambda m: m.startswith("eric_epd.") and _layer(m) != "testing", lambda m, t: _layer(t) != "testing"
    )


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (or a module importing itself), by Tarjan's method."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph.get(node, ()):
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_no_import_circle() -> None:
    assert not _cycles(GRAPH), f"modules importing each other (lazily or not): {_cycles(GRAPH)}"


def test_lower_layers_import_nothing_above_them() -> None:
    """common, media, wire, models, transfer and runtime never reach up into a server, a plugin, the stack or the
    test kit, not even through another module (models may be imported by eric/ and plugins/, not the other way
    round)."""
    up = _climbing_from_lower(GRAPH)
    assert not up, f"arrows climbing up: {up}"


def test_no_layer_reaches_up_the_ladder() -> None:
    """Every layer of eric_epd is on LADDER, and each module reaches only its own layer and those below it (wire/
    never models/, which reads wire/'s schemas; planning/ never stack/, which plans with planning/)."""
    off = sorted({_layer(m) for m in GRAPH if m.startswith("eric_epd.") and _rung(_layer(m)) < 0})
    assert not off, f"layers missing from LADDER: {off}"
    up = _up_the_ladder(GRAPH)
    assert not up, f"arrows up the ladder: {up}"


def test_the_gateway_uses_only_the_shared_wire() -> None:
    """The gateway (router/epd_gateway) reaches eric_epd.common, media and wire, and the package itself (for its
    __version__; `from eric_epd import <a module>` counts as that module), and nothing else, even through them."""
    bad = _gateway_beyond_the_wire(GRAPH)
    assert not bad, f"gateway reaching beyond eric_epd.{{common,media,wire}}: {bad}"


def test_the_gateway_starts_without_torch_or_the_models() -> None:
    """What the static checks say, at run time: importing the gateway's app and command line loads no torch and no
    eric_epd module beyond common, media and wire (torch.save embeddings a client sends import torch when checked)."""
    probe = (
        "import sys, epd_gateway.app, epd_gateway.cli; "
        "print(*sorted(m for m in sys.modules if m == 'torch' or m.startswith('eric_epd.')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PYTHONPATH": f"{ROOT}:{ROOT / 'router'}", "PATH": ""},
    ).stdout.split()
    assert "torch" not in loaded
    assert {_layer(m) for m in loaded} <= set(GATEWAY_MAY_USE), sorted(loaded)


def test_production_code_never_imports_the_test_kit() -> None:
    users = _on_the_test_kit(GRAPH)
    assert not users, f"production modules importing eric_epd.testing: {users}"


OLD_SHAPES: dict[str, set[str]] = {
    "eric_epd": set(),
    "epd_gateway.content": {"eric_epd.wire.handoff"},
    "eric_epd.wire.handoff": {"eric_epd.wire.handles", "eric_epd.models.facts"},
    "eric_epd.wire.handles": set(),
    "eric_epd.wire.eric": set(),
    "eric_epd.models.facts": {"eric_epd.wire.eric"},
    "eric_epd.stack.up": {"eric_epd.planning.profiler"},
    "eric_epd.planning.profiler": {"eric_epd.planning.measure_eric"},
    "eric_epd.planning.measure_eric": {"eric_epd.stack.servers"},
    "eric_epd.stack.servers": set(),
    "eric_epd.common.errors": {"eric_epd.common.http"},
    "eric_epd.common.http": {"eric_epd.eric.app"},
    "eric_epd.eric.app": set(),
    "epd_gateway.routes": {"eric_epd.media.fetch"},
    "eric_epd.media": {"eric_epd.runtime.work"},
    "eric_epd.media.fetch": set(),
    "eric_epd.runtime.work": set(),
}
"""The arrows this test once missed, in a synthetic graph: the gateway on models/ through wire/handoff, planning/ on
stack/ through its own measuring module, a lower module on a server through another, and a package's __init__
importing what the modules under it may not."""


def test_old_shapes_are_caught_through_the_middle_module() -> None:
    gateway = _gateway_beyond_the_wire(OLD_SHAPES)
    assert "epd_gateway.content -> eric_epd.wire.handoff -> eric_epd.models.facts" in gateway
    assert "epd_gateway.routes -> eric_epd.media.fetch -> eric_epd.media -> eric_epd.runtime.work" in gateway
    assert all(_layer(t) in GATEWAY_MAY_USE for t in OLD_SHAPES["epd_gateway.content"])  # not seen directly
    ladder = _up_the_ladder(OLD_SHAPES)
    assert "eric_epd.wire.handoff -> eric_epd.models.facts" in ladder
    assert "eric_epd.planning.profiler -> eric_epd.planning.measure_eric -> eric_epd.stack.servers" in ladder
    assert "eric_epd.stack.up -> eric_epd.planning.profiler" not in ladder  # the stack may plan
    assert "eric_epd.common.errors -> eric_epd.common.http -> eric_epd.eric.app" in _climbing_from_lower(OLD_SHAPES)
    assert not _cycles(OLD_SHAPES)  # none of these is a circle of modules: only the layers see them


def test_eric_router_reads_config_json_once(monkeypatch: pytest.MonkeyPatch, qwen2_vl_tiny: Path) -> None:
    """Everything Eric's router process builds for a checkpoint (the facts, the workload, the pool, the app with its
    SGLang routes, and what its lifespan makes: processor, fingerprint, output spec, service) reads config.json
    once (it was read seven times)."""
    from eric_epd.eric import launch
    from eric_epd.eric.config import EricConfig
    from eric_epd.transfer.config import TransferConfig

    reads: list[Path] = []
    read_text = Path.read_text

    def counting(self: Path, *args: Any, **kwargs: Any) -> str:
        if self.name == "config.json" and self.parent.resolve() == qwen2_vl_tiny.resolve():
            reads.append(self)
        return read_text(self, *args, **kwargs)

    served: list[str] = []

    async def through_lifespan(app: Any) -> None:  # no engine answers: nothing is sent to one
        async with app.router.lifespan_context(app):
            served.append(app.title)

    class NoEngine:  # a stand-in for the engine process: alive, never asked anything
        pid = None

        def is_alive(self) -> bool:
            return True

        def heartbeat_age(self) -> float:
            return 0.0

    def run_server(
        name: str,
        config: EricConfig,
        workload: Any,
        make_pool: Callable[[], Any],
        make_app: Callable[[Any, Any], Any],
        drain_timeout_s: float,
    ) -> None:
        hub = make_pool()
        try:
            asyncio.run(through_lifespan(make_app(NoEngine(), hub)))
        finally:
            hub.close()

    monkeypatch.setattr(Path, "read_text", counting)
    monkeypatch.setattr(launch, "run_server", run_server)
    launch.serve(EricConfig(model=qwen2_vl_tiny, transfer=TransferConfig(pool_bytes=1 << 20, backends=())))
    assert served == ["Eric encode server"]
    assert len(reads) == 1, f"config.json read {len(reads)} times"

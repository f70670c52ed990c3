"""The layers of the project, checked on its source (every import, lazy ones inside functions included): no import
circle, no arrow from a lower layer up, the gateway on the shared wire only, no production code on the test kit; and
Eric's router reads the checkpoint's config.json once."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOWER = ("common", "media", "wire", "models", "transfer", "runtime")
"""What every server and plugin stands on; none of it knows who stands on it."""
UPPER = ("eric", "geri", "plugins", "stack", "testing", "checkpoints", "planning")
GATEWAY_MAY_USE = ("common", "media", "wire")


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
    test kit (models may be imported by eric/ and plugins/, not the other way round)."""
    up = {f"{m} -> {t}" for m, targets in GRAPH.items() if _layer(m) in LOWER
          for t in targets if _layer(t) in UPPER or t.startswith("epd_gateway")}
    assert not up, f"arrows climbing up: {sorted(up)}"


def test_the_gateway_uses_only_the_shared_wire() -> None:
    """The gateway (router/epd_gateway) imports eric_epd.common, media and wire, and the package itself (for its
    __version__; `from eric_epd import <a module>` counts as that module)."""
    allowed = tuple(f"eric_epd.{layer}." for layer in GATEWAY_MAY_USE)
    bad = {f"{m} -> {t}" for m, targets in GRAPH.items() if m.startswith("epd_gateway")
           for t in targets if t.startswith("eric_epd.") and not t.startswith(allowed)}
    assert not bad, f"gateway imports beyond eric_epd.{{common,media,wire}}: {sorted(bad)}"


def test_production_code_never_imports_the_test_kit() -> None:
    users = {f"{m} -> {t}" for m, targets in GRAPH.items() if m.startswith("eric_epd.") and _layer(m) != "testing"
             for t in targets if _layer(t) == "testing"}
    assert not users, f"production modules importing eric_epd.testing: {sorted(users)}"


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

    def run_server(name: str, config: EricConfig, workload: Any, make_pool: Callable[[], Any],
                   make_app: Callable[[Callable[[], bool], Any], Any], drain_timeout_s: float) -> None:
        hub = make_pool()
        try:
            asyncio.run(through_lifespan(make_app(lambda: True, hub)))
        finally:
            hub.close()

    monkeypatch.setattr(Path, "read_text", counting)
    monkeypatch.setattr(launch, "run_server", run_server)
    launch.serve(EricConfig(model=qwen2_vl_tiny, transfer=TransferConfig(pool_bytes=1 << 20, backends=())))
    assert served == ["Eric encode server"]
    assert len(reads) == 1, f"config.json read {len(reads)} times"

"""Servers of a parametrized module fixture launched one parameter ahead: while one family's tests run on its stack,
the next family's stack starts on the other half of the CPUs, so their ~30 s start-ups overlap instead of queueing."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from eric_epd.stack.process import ServerProcess, stop_all
from eric_epd.stack.servers import host_split

if TYPE_CHECKING:
    import pytest

Cpus = tuple[int, ...]


@dataclass
class Launched:
    """One parameter's servers (built, launched by Lookahead) and what its fixture yields once they are healthy."""

    servers: tuple[ServerProcess, ...]
    value: dict[str, Any] = field(default_factory=dict)


Build = Callable[[Any, Cpus, Cpus], Launched]
"""(parameter, the CPUs for its Eric side, the CPUs for its engine side) -> its servers, not yet launched."""


def params_in_order(request: pytest.FixtureRequest, argname: str) -> list[Any]:
    """The values of the parametrized fixture `argname` in the order this session's selected tests of the requesting
    module use them (pytest groups a module-scoped fixture's tests by parameter)."""
    order: list[Any] = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if item.module is not request.module or spec is None or argname not in spec.params:
            continue
        if spec.params[argname] not in order:
            order.append(spec.params[argname])
    return order


class Lookahead:
    """`take(p)` waits for p's servers and launches the next parameter's; `release(p)` stops p's; `close()` stops
    all. Consecutive parameters get the two halves of the host's CPUs swapped, so two stacks' start-ups use both."""

    def __init__(self, order: list[Hashable], build: Build) -> None:
        self._order = order
        self._build = build
        self._launched: dict[Hashable, Launched] = {}

    def take(self, param: Hashable) -> dict[str, Any]:
        """p's yielded value once all its servers are healthy (launched now if not already); the parameter after it
        is launched before the wait."""
        launched = self._launch(param)
        index = self._order.index(param) if param in self._order else -1
        if 0 <= index < len(self._order) - 1:
            self._launch(self._order[index + 1])
        try:
            for server in launched.servers:
                server.wait_ready()
        except BaseException:
            self.release(param)
            raise
        return launched.value

    def release(self, param: Hashable) -> None:
        """Stop p's servers (if launched), each drain cut short after its hurry_s."""
        launched = self._launched.pop(param, None)
        if launched is not None:
            stop_all(*launched.servers, hurry=True)

    def close(self) -> None:
        """Stop every server still launched (a parameter launched ahead that no test took, after a failure)."""
        for param in list(self._launched):
            self.release(param)

    def _launch(self, param: Hashable) -> Launched:
        if param not in self._launched:
            eric, engine = host_split()
            if param in self._order and self._order.index(param) % 2:
                eric, engine = engine, eric
            launched = self._build(param, eric, engine)
            self._launched[param] = launched
            try:
                for server in launched.servers:
                    server.launch()
            except BaseException:
                self.release(param)
                raise
        return self._launched[param]


def lookahead_fixture(request: pytest.FixtureRequest, argname: str, build: Build) -> Iterator[Lookahead]:
    """The body of a module fixture holding a Lookahead over `argname`'s parameters: `yield from` it."""
    lookahead = Lookahead(params_in_order(request, argname), build)
    try:
        yield lookahead
    finally:
        lookahead.close()

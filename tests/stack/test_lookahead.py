"""Lookahead launches the parameter after the one whose tests run, on the other half of the CPUs, and stops each
(its drain cut short) when released; servers here are stand-ins that record what was done to them."""

from __future__ import annotations

from eric_epd.stack.process import ServerProcess
from eric_epd.stack.servers import host_split
from eric_epd.testing.lookahead import Cpus, Launched, Lookahead


class RecordingStandIn(ServerProcess):
    """A server that starts no process: launch, wait_ready and stop are recorded in `log`."""

    hurry_s = 2.0

    def __init__(self, name: str, log: list[str]) -> None:
        super().__init__(["true"], 0)
        self.name, self.log = name, log

    def launch(self):
        self.log.append(f"launch {self.name}")
        return self

    def wait_ready(self):
        self.log.append(f"ready {self.name}")
        return self

    def stop(self, graceful: bool = True, hurry_s: float | None = None) -> None:
        self.log.append(f"stop {self.name} hurry={hurry_s}")


def _lookahead() -> tuple[Lookahead, list[str], dict[str, Cpus]]:
    log: list[str] = []
    engine_cpus: dict[str, Cpus] = {}

    def build(param: str, eric: Cpus, engine: Cpus) -> Launched:
        engine_cpus[param] = engine
        return Launched((RecordingStandIn(param, log),), {"param": param})

    return Lookahead(["a", "b", "c"], build), log, engine_cpus


def test_the_next_is_launched_ahead_and_each_is_stopped_in_a_hurry_when_released() -> None:
    lookahead, log, engine_cpus = _lookahead()
    assert lookahead.take("a") == {"param": "a"}
    assert log == ["launch a", "launch b", "ready a"]
    lookahead.release("a")
    assert lookahead.take("b") == {"param": "b"}
    assert log[3:] == ["stop a hurry=2.0", "launch c", "ready b"]  # b was launched already
    lookahead.close()
    assert sorted(log[6:]) == ["stop b hurry=2.0", "stop c hurry=2.0"]
    eric, engine = host_split()
    assert [engine_cpus[p] for p in "abc"] == [engine, eric, engine]  # the halves alternate

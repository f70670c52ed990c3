"""Lookahead launches the parameters after the one whose tests run (`ahead` of them), on alternating halves of the
CPUs, and stops each when released; servers here are stand-ins that record what was done to them."""

from __future__ import annotations

from eric_epd.stack.process import ServerProcess
from eric_epd.stack.servers import host_split
from eric_epd.testing.lookahead import Cpus, Launched, Lookahead


class RecordingStandIn(ServerProcess):
    """A server that starts no process: launch, wait_ready and stop are recorded in `log`."""

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
        self.log.append(f"stop {self.name}")


def _lookahead(ahead: int) -> tuple[Lookahead, list[str], dict[str, Cpus]]:
    log: list[str] = []
    engine_cpus: dict[str, Cpus] = {}

    def build(param: str, eric: Cpus, engine: Cpus) -> Launched:
        engine_cpus[param] = engine
        return Launched((RecordingStandIn(param, log),), {"param": param})

    return Lookahead(["a", "b", "c", "d"], build, ahead), log, engine_cpus


def test_two_ahead_launches_the_next_two_and_stops_each_when_released() -> None:
    lookahead, log, engine_cpus = _lookahead(ahead=2)
    assert lookahead.take("a") == {"param": "a"}
    assert log == ["launch a", "launch b", "launch c", "ready a"]
    lookahead.release("a")
    assert lookahead.take("b") == {"param": "b"}
    assert log[4:] == ["stop a", "launch d", "ready b"]  # c was launched already
    lookahead.close()
    assert sorted(log[7:]) == ["stop b", "stop c", "stop d"]
    eric, engine = host_split()
    assert [engine_cpus[p] for p in "abcd"] == [engine, eric, engine, eric]  # the halves alternate


def test_one_ahead_is_the_default() -> None:
    lookahead, log, _ = _lookahead(ahead=1)
    lookahead.take("a")
    assert log == ["launch a", "launch b", "ready a"]
    lookahead.close()

"""The profiler starts its servers only through the Servers it is given (planning/ never imports the stack): on each
share, Eric alone and then the engine alone, with the share's CPUs or GPUs; and the stack's LocalServers builds the
EricServer and VllmServe those calls name, started only inside their `with` blocks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from eric_epd.planning import profiler
from eric_epd.planning.servers import Endpoint, Servers
from eric_epd.stack.servers import EricServer, LocalServers, VllmServe


class RecordingServers:
    """Servers that start nothing: each `with` block is recorded (entered, exited) with the arguments it was given."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    @contextmanager
    def _serve(self, kind: str, kwargs: dict[str, Any]) -> Iterator[Endpoint]:
        self.events.append(("enter", kind, kwargs))
        yield SimpleNamespace(url=f"http://{kind}", headers={})
        self.events.append(("exit", kind, kwargs))

    def eric(self, model: Path, **kwargs: Any) -> Any:
        return self._serve("eric", kwargs)

    def engine(self, model: Path, **kwargs: Any) -> Any:
        return self._serve("engine", kwargs)


def test_each_share_starts_eric_then_the_engine_through_the_servers_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(profiler, "measure_eric", lambda eric, *args: [eric.url])
    monkeypatch.setattr(profiler, "measure_engine", lambda vllm, *args: vllm.url)
    servers = RecordingServers()
    config = profiler.ProfileConfig(
        model=tmp_path, out=tmp_path / "profile.json", shares=((2, 3),), device="cuda", dtype="bfloat16", batches=(1, 4)
    )
    share = profiler.profile_share(config, (2, 3), tmp_path, servers)
    assert (share.eric, share.engine) == (["http://eric"], "http://engine")
    assert [(event, kind) for event, kind, _ in servers.events] == [
        ("enter", "eric"),
        ("exit", "eric"),
        ("enter", "engine"),
        ("exit", "engine"),
    ]
    eric, engine = servers.events[0][2], servers.events[2][2]
    gpus = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert eric == {
        "tp": 2,
        "cpus": None,
        "env": gpus,
        "log_path": tmp_path / "eric_2-3.log",
        "extra_args": ("--dtype", "bfloat16", "--device", "cuda"),
    }
    assert engine["cpus"] is None and engine["env"] == gpus and engine["dtype"] == "bfloat16"
    assert engine["log_path"] == tmp_path / "vllm_2-3.log" and engine["max_model_len"] == config.max_model_len
    assert engine["extra_args"][-2:] == ("--tensor-parallel-size", "2")


def test_local_servers_are_the_stacks_launchers_not_yet_started(tmp_path: Path) -> None:
    servers: Servers = LocalServers()
    with_env = {"PROFILE_ENV": "1"}
    eric = servers.eric(
        tmp_path, tp=1, cpus=(0,), env=with_env, log_path=tmp_path / "e.log", extra_args=("--dtype", "float32")
    )
    engine = servers.engine(
        tmp_path,
        cpus=(1,),
        env=with_env,
        log_path=tmp_path / "v.log",
        extra_args=("--seed", "0"),
        dtype="float16",
        max_model_len=1024,
    )
    assert isinstance(eric, EricServer) and isinstance(engine, VllmServe)
    assert eric.proc is None and engine.proc is None
    assert eric.cpus == (0,) and eric._cmd[-2:] == ["--dtype", "float32"] and eric._env["PROFILE_ENV"] == "1"
    assert engine.cpus == (1,) and engine._cmd[-2:] == ["--seed", "0"] and engine._env["PROFILE_ENV"] == "1"
    assert "--ec-transfer-config" not in engine._cmd  # the engine alone, no Eric behind it
    assert engine._cmd[engine._cmd.index("--dtype") + 1] == "float16"
    assert engine._cmd[engine._cmd.index("--max-model-len") + 1] == "1024"

"""What the profiler needs of the servers it measures, and nothing of how they start: an Endpoint (a URL and its
clients' headers) and Servers, which start Eric or the engine on a device share around a `with` block. The local
subprocess launchers (stack/servers.LocalServers) implement it; `eric-epd profile` passes them in, so planning/
never imports the stack (the stack imports planning: `eric-epd up --plan-from`)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol


class Endpoint(Protocol):
    """A started server: its base URL and what a client sends to pass its key check."""

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:8000."""
        ...

    @property
    def headers(self) -> dict[str, str]:
        """Headers every request carries (its key)."""
        ...


class Servers(Protocol):
    """Starts the two servers a profile measures, each alone on one device share: healthy on entering the `with`
    block, stopped on leaving it."""

    def eric(
        self,
        model: Path,
        *,
        tp: int,
        cpus: tuple[int, ...] | None,
        env: dict[str, str],
        log_path: Path,
        extra_args: tuple[str, ...],
    ) -> AbstractContextManager[Endpoint]:
        """Eric serving `model` at `tp` ranks, pinned to `cpus` (None: any), `env` added, with `extra_args`."""
        ...

    def engine(
        self,
        model: Path,
        *,
        cpus: tuple[int, ...] | None,
        env: dict[str, str],
        log_path: Path,
        extra_args: tuple[str, ...],
        dtype: str,
        max_model_len: int,
    ) -> AbstractContextManager[Endpoint]:
        """`vllm serve` on `model` alone (no Eric behind it), with `extra_args`."""
        ...

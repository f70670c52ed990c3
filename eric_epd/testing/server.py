"""The transfer-only producer process of eric_epd.testing.pool_server, started like the stack's servers."""

from __future__ import annotations

import sys
from pathlib import Path

from eric_epd.stack.process import ServerProcess, free_port


class PoolServer(ServerProcess):
    """The transfer-only producer of eric_epd.testing.pool_server."""

    health_path = "/v1/transfer"

    def __init__(
        self,
        backends: str = "shm,mooncake,nixl",
        pool_bytes: int = 1 << 30,
        ttl_s: float = 300.0,
        log_path: Path | None = None,
    ) -> None:
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "eric_epd.testing.pool_server",
            "--port",
            str(port),
            "--backends",
            backends,
            "--pool-bytes",
            str(pool_bytes),
            "--ttl",
            str(ttl_s),
        ]
        super().__init__(cmd, port, log_path, 60.0)

"""A transfer-only producer for tests and benchmarks: Eric's pool, backends and control API, no model.

`python -m eric_epd.testing.pool_server --port P --backends shm,mooncake,nixl`; then
POST /v1/testing/entries {"hash", "nbytes", "seed", "leases"} stores seeded random bytes (or, with "data": base64
bytes, "shape" and "dtype", exactly that tensor) and returns the first lease's handle plus every lease token
("leases").
"""

from __future__ import annotations

import argparse
import base64
import logging
from pathlib import Path

import msgspec
import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from eric_epd.eric.config import EricConfig
from eric_epd.eric.launch import transfer_hub
from eric_epd.runtime.router import install_error_handlers
from eric_epd.transfer.config import TransferConfig
from eric_epd.transfer.producer import TransferHub
from eric_epd.transfer.routes import transfer_routes


def seeded_bytes(nbytes: int, seed: int) -> np.ndarray:
    """The bytes an entry made with `seed` holds (consumers regenerate them to check)."""
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def create_pool_app(hub: TransferHub) -> FastAPI:
    """The transfer routes over `hub`, plus POST /v1/testing/entries to put a leased entry in the pool."""
    app = FastAPI(title="eric-epd transfer test producer")
    app.include_router(transfer_routes(hub))
    install_error_handlers(app)

    @app.post("/v1/testing/entries")
    async def put(request: Request) -> JSONResponse:
        body = await request.json()
        key = body["hash"]
        data = base64.b64decode(body["data"]) if "data" in body else None
        nbytes = len(data) if data is not None else int(body["nbytes"])
        shape, dtype = tuple(body.get("shape", (nbytes,))), body.get("dtype", "uint8")
        entry = await hub.reserve(key, nbytes, shape, dtype)
        hub.pool.view(entry)[:] = (
            np.frombuffer(data, np.uint8) if data is not None else seeded_bytes(nbytes, int(body.get("seed", 0)))
        )
        hub.pool.commit(key)
        handles = [hub.lease(key) for _ in range(int(body.get("leases", 1)))]
        return JSONResponse(msgspec.to_builtins(handles[0]) | {"leases": [h.lease for h in handles]})

    return app


def main() -> None:
    """Serve a model-less producer on 127.0.0.1 with the backends and pool the flags name."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True, help="HTTP port")
    ap.add_argument("--backends", default="shm,mooncake,nixl", help="transfer backends to offer")
    ap.add_argument("--pool-bytes", type=int, default=1 << 30, help="size of the embedding pool")
    ap.add_argument("--ttl", type=float, default=300.0, help="seconds a lease lives unacknowledged")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    config = EricConfig(
        model=Path("."),
        port=args.port,
        transfer=TransferConfig(pool_bytes=args.pool_bytes, ttl_s=args.ttl, backends=tuple(args.backends.split(","))),
    )
    hub = transfer_hub(config)
    try:
        uvicorn.run(
            create_pool_app(hub), host="127.0.0.1", port=args.port, log_level="warning", proxy_headers=False
        )  # the peer is the connecting address, whatever headers say
    finally:
        hub.close()


if __name__ == "__main__":
    main()

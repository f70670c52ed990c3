"""HTTP control API of the transfer layer: embedding fetch (the fallback backend), ack, stats, NIXL metadata."""

from __future__ import annotations

import json

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from eric_epd.transfer.producer import TransferHub
from eric_epd.transfer.safetensors_io import safetensors_bytes


class TransferApiError(Exception):
    """Answered as {"error": {...}} by the app's handler for this type."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def transfer_routes(hub: TransferHub) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/embeddings/{content_hash}")
    async def embedding(content_hash: str) -> Response:
        entry = hub.pool.get(content_hash)
        if entry is None or not entry.ready:
            raise TransferApiError(404, f"no embedding {content_hash} held: never encoded here, acknowledged, "
                                        "or expired")
        body = safetensors_bytes(hub.pool.view(entry), entry.shape, entry.dtype)
        return Response(body, media_type="application/octet-stream",
                        headers={"X-Eric-Shape": ",".join(map(str, entry.shape)), "X-Eric-Dtype": entry.dtype,
                                 "X-Eric-Instance": hub.instance_id})

    @router.post("/v1/embeddings/{content_hash}/ack")
    async def ack(content_hash: str, request: Request) -> JSONResponse:
        body = await request.body()
        try:
            fields = json.loads(body) if body.strip() else {}
            instance_id, generation = fields.get("instance_id"), fields.get("generation")
        except (json.JSONDecodeError, AttributeError) as e:
            raise TransferApiError(400, f'ack body must be {{"instance_id": "...", "generation": N}}: {e}') from e
        status, message = hub.ack(content_hash, instance_id, generation)
        if status != 200:
            raise TransferApiError(status, message)
        return JSONResponse({"status": "ok"})

    @router.get("/v1/embeddings/{content_hash}/handle")
    async def handle(content_hash: str) -> JSONResponse:
        """Where an embedding held here can be read; adds no lease (the encode request already took one)."""
        entry = hub.pool.get(content_hash)
        if entry is None or not entry.ready:
            raise TransferApiError(404, f"no embedding {content_hash} held here")
        return JSONResponse(msgspec.to_builtins(hub.handle(entry)))

    @router.post("/v1/embeddings/{content_hash}/lease")
    async def lease(content_hash: str, request: Request) -> JSONResponse:
        """More readers of one entry (e.g. every tensor-parallel rank of a consumer); each acknowledges once."""
        body = await request.json()
        count = body.get("count", 1) if isinstance(body, dict) else None
        if not isinstance(count, int) or not 1 <= count <= 1024:
            raise TransferApiError(400, '"count" must be an integer from 1 to 1024')
        entry = hub.pool.get(content_hash)
        if entry is None or not entry.ready:
            raise TransferApiError(404, f"no embedding {content_hash} held here")
        for _ in range(count):
            hub.pool.lease(content_hash)
        return JSONResponse({"leases": entry.leases})

    @router.get("/v1/transfer")
    async def transfer() -> JSONResponse:
        return JSONResponse(hub.stats())

    @router.get("/v1/transfer/nixl/metadata")
    async def nixl_metadata() -> Response:
        backend = hub.backend("nixl")
        if backend is None:
            raise TransferApiError(404, "NIXL is not enabled on this Eric (--transfer-backends)")
        return Response(backend.metadata(), media_type="application/octet-stream")

    return router

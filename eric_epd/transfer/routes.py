"""HTTP control API of the transfer layer: embedding fetch (the fallback backend), ack, stats, NIXL metadata."""

from __future__ import annotations

import json

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
            instance_id = json.loads(body).get("instance_id") if body.strip() else None
        except (json.JSONDecodeError, AttributeError) as e:
            raise TransferApiError(400, f'ack body must be {{"instance_id": "..."}}: {e}') from e
        status, message = hub.ack(content_hash, instance_id)
        if status != 200:
            raise TransferApiError(status, message)
        return JSONResponse({"status": "ok"})

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

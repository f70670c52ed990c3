"""HTTP control API of the transfer layer: embedding fetch (the fallback backend), lease, ack, stats, NIXL metadata.

Every per-embedding route needs the lease token (X-Eric-Lease) the encode answer handed out; a wrong or missing
token is answered exactly like an unknown hash (404) and changes nothing."""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from eric_epd.common.errors import ApiError, parse_body, read_body
from eric_epd.transfer.pool import PoolEntry
from eric_epd.transfer.producer import TransferHub
from eric_epd.transfer.safetensors_io import safetensors_bytes
from eric_epd.wire.handles import LEASE_HEADER, AckAnswer

CONTROL_BODY_LIMIT = 4096
"""Lease and ack bodies are a few fields; anything larger is refused (413) before it is read."""


async def _small_json(request: Request) -> dict:
    """A control body: at most CONTROL_BODY_LIMIT bytes of JSON object (empty means {})."""
    body = await read_body(request, CONTROL_BODY_LIMIT)
    fields = parse_body(body) if body.strip() else {}
    if not isinstance(fields, dict):
        raise ApiError(400, "the body must be a JSON object")
    return fields


def _leased(hub: TransferHub, content_hash: str, request: Request) -> tuple[PoolEntry, str]:
    """(entry, token) for the lease the request's X-Eric-Lease header names, else LeaseError 404."""
    token = request.headers.get(LEASE_HEADER)
    return hub.pool.holder(content_hash, token), token  # type: ignore[return-value]


def transfer_routes(hub: TransferHub) -> APIRouter:
    """The transfer layer's routes (embedding bytes, ack, lease, handle, stats, NIXL metadata) over `hub`; their
    errors are ApiErrors (LeaseError included) for the app's handler."""
    router = APIRouter()

    @router.get("/v1/embeddings/{content_hash}")
    async def embedding(content_hash: str, request: Request) -> Response:
        entry, _ = _leased(hub, content_hash, request)
        body = safetensors_bytes(hub.pool.view(entry), entry.shape, entry.dtype)
        return Response(
            body,
            media_type="application/octet-stream",
            headers={
                "X-Eric-Shape": ",".join(map(str, entry.shape)),
                "X-Eric-Dtype": entry.dtype,
                "X-Eric-Instance": hub.instance_id,
            },
        )

    @router.post("/v1/embeddings/{content_hash}/ack")
    async def ack(content_hash: str, request: Request) -> Response:
        """Ends exactly the lease the token names; repeating it is a 404 that changes nothing, except a repeat
        marked `"retry": true` (the first attempt's answer was lost) of an ack that took effect: a 200 "already
        acknowledged". With `"keep": true` a child lease takes its place and is answered (`AckAnswer.lease`)."""
        fields = await _small_json(request)
        instance_id = fields.get("instance_id")
        if instance_id is not None and not isinstance(instance_id, str):
            raise ApiError(400, '"instance_id" must be a string')
        retry, keep = fields.get("retry", False), fields.get("keep", False)
        if not isinstance(retry, bool) or not isinstance(keep, bool):
            raise ApiError(400, '"retry" and "keep" must be booleans')
        token = request.headers.get(LEASE_HEADER)
        status, message, child = (
            hub.hand_over(content_hash, token, instance_id, retry)
            if keep
            else (*hub.ack(content_hash, token, instance_id, retry), None)
        )
        if status != 200:
            raise ApiError(status, message)
        return Response(msgspec.json.encode(AckAnswer(message, child)), media_type="application/json")

    @router.get("/v1/embeddings/{content_hash}/handle")
    async def handle(content_hash: str, request: Request) -> JSONResponse:
        """Where the embedding the token leases can be read; adds no lease."""
        entry, token = _leased(hub, content_hash, request)
        return JSONResponse(msgspec.to_builtins(hub.handle(entry, token)))

    @router.post("/v1/embeddings/{content_hash}/lease")
    async def lease(content_hash: str, request: Request) -> JSONResponse:
        """Child leases of the token's lease (e.g. one per tensor-parallel rank of a consumer), each acknowledged
        on its own; bounded per lease (pool.MAX_CHILD_LEASES)."""
        count = (await _small_json(request)).get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool):
            raise ApiError(400, '"count" must be an integer')
        tokens = hub.pool.add_leases(content_hash, request.headers.get(LEASE_HEADER), count)
        return JSONResponse({"leases": tokens})

    @router.get("/v1/transfer")
    async def transfer() -> JSONResponse:
        return JSONResponse(msgspec.to_builtins(hub.stats()))

    @router.get("/v1/transfer/nixl/metadata")
    async def nixl_metadata() -> Response:
        backend = hub.backend("nixl")
        if backend is None:
            raise ApiError(404, "NIXL is not enabled on this Eric (--transfer-backends)")
        return Response(backend.metadata(), media_type="application/octet-stream")

    return router

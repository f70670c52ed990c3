"""The gateway app: its routes (routes.py) over a `Gateway` that its lifespan opens with the upstream clients and
the encoders' health loop (and DNS membership when configured)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette

from epd_gateway.config import GatewayConfig
from epd_gateway.dns_members import DnsMembers
from epd_gateway.encode_call import new_encoder_session
from epd_gateway.gateway import Gateway
from epd_gateway.metrics import GatewayMetrics
from epd_gateway.routes import GatewayRoutes
from epd_gateway.upstream import new_session
from eric_epd.common.http import bearer

logger = logging.getLogger(__name__)


def create_app(config: GatewayConfig) -> Starlette:
    """The gateway's Starlette app: its routes, and a lifespan that opens the clients and runs the health loop."""
    metrics = GatewayMetrics()
    state: dict[str, Gateway] = {}

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        # idle connections are dropped before uvicorn's 5 s keep-alive timeout closes them under us
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=128, keepalive_expiry=2.0)
        async with (
            httpx.AsyncClient(
                limits=limits, timeout=config.upstream_timeout_s, headers=bearer(config.eric_api_key)
            ) as client,
            httpx.AsyncClient(limits=limits, timeout=config.upstream_timeout_s) as unkeyed,
            new_session(config) as session,
            new_encoder_session(bearer(config.eric_api_key)) as encode_session,
        ):
            state["gw"] = Gateway(config, client, session, metrics, unkeyed, encode_session)
            tasks = [asyncio.create_task(state["gw"].encoders.health_loop(config.health_interval_s))]
            if config.encoder_dns:
                members = DnsMembers(config.encoder_dns, state["gw"].encoders, config.dns_interval_s)
                await members.refresh()  # serving starts with the Erics the names list now
                tasks.append(asyncio.create_task(members.run()))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await state["gw"].inliner.aclose()

    routes = GatewayRoutes(config, metrics, lambda: state["gw"])
    # plain Starlette: no route needs FastAPI's validation, and it costs time on every proxied request
    return Starlette(routes=routes.routes(), lifespan=lifespan, exception_handlers=routes.exception_handlers())

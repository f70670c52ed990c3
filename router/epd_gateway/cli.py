"""`epd-gateway --encoder-urls ... --colocated-urls ...` (or --prefill-urls/--decode-urls)."""

from __future__ import annotations

import logging

import uvicorn

from epd_gateway.app import create_app
from epd_gateway.config import parse_args
from eric_epd.common.heap import keep_freed_heap
from eric_epd.common.proxies import uvicorn_proxy_settings


def main(argv: list[str] | None = None) -> None:
    """Parse the flags and serve the gateway with uvicorn."""
    config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(name)s %(levelname)s %(message)s")
    keep_freed_heap(config.heap_keep_bytes)
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
        **uvicorn_proxy_settings(config.trusted_proxies),
    )


if __name__ == "__main__":
    main()

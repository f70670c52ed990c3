"""The Eric connector's settings: `ec_connector_extra_config` keys and the ERIC_API_KEY environment variable, parsed
once per vLLM process."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from eric_epd.common.dns import DnsTarget, parse_dns_target
from eric_epd.transfer.client import MooncakeOptions
from eric_epd.wire.handles import BACKENDS

API_KEY_ENV = "ERIC_API_KEY"
"""The Erics' API key reaches vLLM's processes through the environment, never a command line."""


@dataclass(frozen=True)
class EricConnectorSettings:
    """`ec_connector_extra_config` keys and the ERIC_API_KEY environment variable, parsed once."""

    eric_urls: tuple[str, ...]
    backends: tuple[str, ...]
    api_key: str | None
    staging_bytes: int = 256 << 20
    """Size of each worker's landing area (device memory on GPUs); landed items awaiting their step are also held
    as copies in the model's dtype."""
    prefetch_threads: int = 4
    fetch_timeout_s: float = 30.0
    mooncake: MooncakeOptions = field(default_factory=MooncakeOptions)
    eric_dns: tuple[DnsTarget, ...] = ()
    """Names whose every address is a trusted Eric at the given port (a Kubernetes headless Service)."""
    dns_interval_s: float = 2.0

    @classmethod
    def parse(cls, extra: dict[str, Any], environ: dict[str, str] | os._Environ = os.environ) -> EricConnectorSettings:
        """The parsed settings; ValueError for no Erics, an unknown transfer backend or Mooncake protocol."""
        urls, names = (extra.get(key, []) for key in ("eric_urls", "eric_dns"))
        urls, names = ([u for u in v.split(",") if u] if isinstance(v, str) else list(v) for v in (urls, names))
        if not urls and not names:
            raise ValueError(
                'EricECConnector needs ec_connector_extra_config {"eric_urls": ["http://host:port"]} '
                'or {"eric_dns": ["name:port"]}'
            )
        backends = tuple(extra.get("backends", BACKENDS))
        unknown = set(backends) - set(BACKENDS)
        if unknown:
            raise ValueError(f"unknown Eric transfer backends {sorted(unknown)}; choose from {BACKENDS}")
        settings = cls(
            tuple(u.rstrip("/") for u in urls),
            backends,
            environ.get(API_KEY_ENV) or None,
            int(extra.get("staging_bytes", cls.staging_bytes)),
            int(extra.get("prefetch_threads", cls.prefetch_threads)),
            float(extra.get("fetch_timeout_s", cls.fetch_timeout_s)),
            MooncakeOptions(
                str(extra.get("mooncake_host", MooncakeOptions.host)),
                str(extra.get("mooncake_protocol", MooncakeOptions.protocol)),
                str(extra.get("mooncake_device", MooncakeOptions.device)),
                str(extra.get("global_cache", "")),
            ),
            tuple(dict.fromkeys(parse_dns_target(str(n)) for n in names)),
            float(extra.get("dns_interval_s", cls.dns_interval_s)),
        )
        if settings.mooncake.protocol not in ("tcp", "rdma", "efa"):
            raise ValueError(f"mooncake_protocol {settings.mooncake.protocol!r}: choose tcp, rdma or efa")
        if (
            settings.staging_bytes < 1 << 20
            or settings.prefetch_threads < 1
            or settings.fetch_timeout_s <= 0
            or settings.dns_interval_s <= 0
        ):
            raise ValueError(
                "ec_connector_extra_config: staging_bytes >= 1 MiB, prefetch_threads >= 1, "
                "fetch_timeout_s > 0 and dns_interval_s > 0 are required"
            )
        return settings

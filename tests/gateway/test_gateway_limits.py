"""The gateway's per-request bounds without engines: the media it inlines (one budget per request, each URL fetched
once, from a real local HTTP server and real files), the DNS pre-check's deadline, the SGLang processor options it
refuses, and the images route's `size` and text-encoder errors."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from epd_gateway.boundary import check_request_fields
from epd_gateway.config import parse_args
from epd_gateway.content import collect_media
from epd_gateway.images import ImageGenerator, parse_images_body
from epd_gateway.inline import MediaInliner, check_hosts

from eric_epd.common.errors import ApiError
from eric_epd.media.fetch import ByteBudget, MediaFetcher
from eric_epd.media.limits import MediaLimits
from eric_epd.media.resolver import MAX_HOSTS_PER_REQUEST
from eric_epd.media.url_policy import MediaError, UrlPolicy

LIMITS = MediaLimits(max_bytes=1 << 20, timeout_s=5.0)


def _blob(size: int) -> bytes:
    """`size` bytes the gateway takes for a PNG (its signature, then filler): only their count matters here."""
    return (b"\x89PNG\r\n\x1a\n" + b"x" * size)[:size]


class _Blobs(BaseHTTPRequestHandler):
    """GET /<n>: n bytes; /stream/<n>: the same without a Content-Length (counted as they come). Hits counted."""

    hits: Counter[str] = Counter()
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        self.hits[self.path] += 1
        size = int(self.path.rsplit("/", 1)[1])
        self.send_response(200)
        if not self.path.startswith("/stream/"):
            self.send_header("Content-Length", str(size))
        self.end_headers()
        blob = _blob(size)
        for start in range(0, size, 4096):
            self.wfile.write(blob[start : start + 4096])

    def log_message(self, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """A fetch the budget stops mid-body resets the connection: expected here, not a traceback to print."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def blobs() -> Iterator[str]:
    server = _Server(("127.0.0.1", 0), _Blobs)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _images(*urls: str) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}} for url in urls]}],
    }


def _inline(body: dict, budget: int, policy: UrlPolicy) -> dict | None:
    async def go() -> dict | None:
        inliner = MediaInliner(policy, LIMITS, budget)
        try:
            budget_ = inliner.budget()
            try:
                return await inliner.inline(body, collect_media(body, policy, max_items=16), budget_)
            finally:
                budget_.close()
                assert inliner.held.held == 0  # every byte given back when the request ends
        finally:
            await inliner.aclose()

    return asyncio.run(go())


def _over(body: dict, budget: int, policy: UrlPolicy) -> ApiError:
    with pytest.raises(ApiError) as e:
        _inline(body, budget, policy)
    assert e.value.status == 413 and "--max-inline-bytes" in e.value.message
    assert str(budget) in e.value.message
    return e.value


def test_a_url_named_many_times_is_fetched_once_and_every_part_counts(blobs: str) -> None:
    policy = UrlPolicy(host_allowlist=frozenset({"127.0.0.1"}))
    url = f"{blobs}/once/30000"
    out = _inline(_images(*[url] * 16), 16 * 30000, policy)
    assert _Blobs.hits["/once/30000"] == 1
    sent = [part["image_url"]["url"] for part in out["messages"][0]["content"]]
    assert sent == ["data:application/octet-stream;base64," + base64.b64encode(_blob(30000)).decode()] * 16
    _over(_images(*[f"{blobs}/twice/30000"] * 16), 16 * 30000 - 1, policy)  # one fetch, sixteen parts inlined
    assert _Blobs.hits["/twice/30000"] == 1


def test_the_request_budget_stops_distinct_fetches_together(blobs: str) -> None:
    policy = UrlPolicy(host_allowlist=frozenset({"127.0.0.1"}))
    each = [f"{blobs}/{i}/300000" for i in range(4)]  # 300 kB each, under the 1 MiB item limit
    assert len(_inline(_images(*each), 4 * 300000, policy)["messages"][0]["content"]) == 4
    _over(_images(*each), 1000000, policy)  # announced lengths: refused before all are read
    _over(_images(*[f"{blobs}/stream/{i}/300000" for i in range(4)]), 1000000, policy)  # counted chunk by chunk


def test_media_inlined_for_every_request_together_are_bounded(blobs: str) -> None:
    """Two requests of 600 kB each under a 1 MB gateway-wide bound: the second is a 503 with Retry-After while the
    first is in flight, and is served once the first has ended."""
    policy = UrlPolicy(host_allowlist=frozenset({"127.0.0.1"}))
    first, second = _images(*[f"{blobs}/g1/{i}/300000" for i in range(2)]), _images(f"{blobs}/g2/600000")

    async def go() -> tuple[ApiError, int, int]:
        inliner = MediaInliner(policy, LIMITS, 1 << 20, max_total_bytes=1_000_000)
        try:
            held = inliner.budget()
            await inliner.inline(first, collect_media(first, policy, max_items=16), held)
            with pytest.raises(ApiError) as busy:
                await inliner.inline(second, collect_media(second, policy, max_items=16), other := inliner.budget())
            other.close()
            during = inliner.held.held
            held.close()
            later = inliner.budget()
            await inliner.inline(second, collect_media(second, policy, max_items=16), later)
            later.close()
            return busy.value, during, inliner.held.held
        finally:
            await inliner.aclose()

    busy, during, after = asyncio.run(go())
    assert busy.status == 503 and busy.retry_after == 1.0 and "--max-inline-total-bytes" in busy.message
    assert during == 600000 and after == 0


def test_files_count_against_the_budget(tmp_path: Path) -> None:
    policy = UrlPolicy(file_roots=(tmp_path.resolve(),))
    for name in "abc":
        (tmp_path / name).write_bytes(_blob(100))
    urls = [(tmp_path / name).resolve().as_uri() for name in "abc"]
    assert _inline(_images(*urls), 300, policy) is not None
    _over(_images(*urls), 299, policy)


def test_byte_budget_is_a_413_for_the_fetch_that_passes_it() -> None:
    async def go() -> None:
        fetcher = MediaFetcher(UrlPolicy(), LIMITS)
        budget = ByteBudget(5, "over the request's budget")
        try:
            assert await fetcher.fetch("data:text/plain;base64,QUJD", budget) == b"ABC"
            with pytest.raises(MediaError, match="over the request's budget") as e:
                await fetcher.fetch("data:text/plain;base64,QUJD", budget)
            assert e.value.status == 413
        finally:
            await fetcher.aclose()

    asyncio.run(go())


def test_max_inline_bytes_flag() -> None:
    config = parse_args(["--colocated-urls", "http://e:1", "--max-inline-bytes", "1234"])
    assert config.max_inline_bytes == 1234
    assert parse_args(["--colocated-urls", "http://e:1"]).max_inline_bytes == config.max_body_bytes
    with pytest.raises(ValueError, match="max-inline-bytes"):
        parse_args(["--colocated-urls", "http://e:1", "--max-inline-bytes", "0"])


def test_heap_keep_bytes_flag() -> None:
    assert parse_args(["--colocated-urls", "http://e:1"]).heap_keep_bytes == 64 * 2**20
    assert parse_args(["--colocated-urls", "http://e:1", "--heap-keep-bytes", "0"]).heap_keep_bytes == 0
    for refused in ("-1", "4096"):
        with pytest.raises(ValueError, match="heap-keep-bytes"):
            parse_args(["--colocated-urls", "http://e:1", "--heap-keep-bytes", refused])


async def _resolve(host: str, port: int) -> list[str]:
    """Hosts named "hang*" never answer (a blackholed nameserver), "bad*" are refused, the rest resolve."""
    if host.startswith("hang"):
        await asyncio.Event().wait()
    if host.startswith("bad"):
        raise MediaError(400, f"host {host} resolves to a private/loopback/reserved address; refused")
    return ["203.0.113.7"]


def _check(*hosts: str, timeout_s: float = 0.2) -> ApiError | None:
    try:
        asyncio.run(check_hosts(_resolve, {(host, 80) for host in hosts}, timeout_s))
    except ApiError as e:
        return e
    return None


def test_host_lookups_run_together_under_one_deadline() -> None:
    assert _check("a.example", "b.example") is None
    hung = _check("hang1.example", "a.example", "hang2.example")
    assert hung is not None and hung.status == 408
    assert (
        "hang1.example" in hung.message
        and "hang2.example" in hung.message
        and "a.example" not in hung.message.replace("hang1.example", "").replace("hang2.example", "")
    )
    refused = _check("hang.example", "bad.example", timeout_s=600.0)  # a refusal does not wait on the hung lookup
    assert refused is not None and refused.status == 400 and "bad.example" in refused.message


def test_hosts_per_request_are_capped() -> None:
    assert _check(*(f"h{i}.example" for i in range(MAX_HOSTS_PER_REQUEST))) is None
    over = _check(*(f"h{i}.example" for i in range(MAX_HOSTS_PER_REQUEST + 1)))
    assert over is not None and over.status == 400
    assert f"{MAX_HOSTS_PER_REQUEST + 1} hosts, over the limit of {MAX_HOSTS_PER_REQUEST}" in over.message


SGLANG_PROCESSOR_OPTIONS = {
    "images_config": {"max_pixels": 1},
    "video_config": {"fps": 30},
    "use_audio_in_video": True,
    "max_dynamic_patch": 64,
    "min_dynamic_patch": 1,
}


@pytest.mark.parametrize("name", sorted(SGLANG_PROCESSOR_OPTIONS))
def test_sglang_processor_options_are_refused(name: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], name: SGLANG_PROCESSOR_OPTIONS[name]}
    for chat in (True, False):
        with pytest.raises(ApiError) as e:
            check_request_fields(body, chat=chat)
        assert e.value.status == 400 and e.value.param == name and f"'{name}'" in e.value.message


@pytest.mark.parametrize("size", ["²x²", "1024x1024x1", "x512", "5 12x512", "123456x1", "\u0661\u0660x10"])
def test_image_size_is_ascii_digits_or_a_400(size: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_images_body(json.dumps({"prompt": "a cat", "size": size}).encode(), urls=False)
    assert e.value.status == 400 and e.value.param == "size"
    assert parse_images_body(b'{"prompt": "a cat", "size": "512x256"}', urls=False)[1:] == (512, 256)


def _encoder_answers(status: int, answer: dict) -> ApiError:
    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(status, json=answer)))
    generator = ImageGenerator(("http://10.1.2.3:8000",), ("http://geri:1",), client, "k", None)
    with pytest.raises(ApiError) as e:
        asyncio.run(generator.hidden_states("a cat"))
    return e.value


def test_text_encoder_refusals_reach_the_client_as_theirs() -> None:
    too_long = {
        "error": {
            "message": "This model's maximum context length is 128 tokens. However, you requested 4100 "
            "tokens (http://10.1.2.3:8000/pooling)",
            "type": "BadRequestError",
            "code": 400,
        }
    }
    refused = _encoder_answers(400, too_long)
    assert refused.status == 400 and "maximum context length is 128 tokens" in refused.message
    assert "10.1.2.3" not in refused.message and "<internal>" in refused.message
    assert _encoder_answers(422, {"object": "error", "message": "bad input"}).status == 422
    assert _encoder_answers(401, {"error": {"message": "Unauthorized"}}).status == 502  # the gateway's own key
    assert _encoder_answers(500, {"error": {"message": "boom"}}).status == 503  # unchanged: the encoder's failure


def test_max_items_stays_within_what_the_engines_connector_takes() -> None:
    from epd_gateway.config import GatewayConfig

    from eric_epd.wire.handoff import MAX_HANDLES

    assert GatewayConfig(colocated_urls=("http://e:1",), max_items=MAX_HANDLES // 2).max_items == MAX_HANDLES // 2
    with pytest.raises(ValueError, match=f"at most {MAX_HANDLES // 2}"):  # with soundtracks, more handles than it takes
        GatewayConfig(colocated_urls=("http://e:1",), max_items=MAX_HANDLES // 2 + 1)

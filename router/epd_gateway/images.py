"""OpenAI's POST /v1/images/generations: the prompt's last hidden states from vLLM serving the text encoder as a
pooling model (`token_embed`, no normalisation), then Geri turns them into the image."""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import re
import time
from typing import Annotated, Literal

import httpx
import msgspec
import numpy as np
import orjson

from epd_gateway.image_store import ImageStore
from epd_gateway.redact import redact
from eric_epd.common.all_or_none import all_or_none
from eric_epd.common.errors import ApiError, parse_body
from eric_epd.common.http import bearer
from eric_epd.common.jsonbody import MAX_ID
from eric_epd.wire.geri import MAX_PROMPT_TOKENS, generate_body

logger = logging.getLogger(__name__)

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
    "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
    "<|im_end|>\n<|im_start|>assistant\n"
)
"""QwenImagePipeline's prompt template; its first TEMPLATE_TOKENS tokens' states are dropped, as the pipeline drops
them (prompt_template_encode_start_idx)."""
TEMPLATE_TOKENS = 34
MAX_PROMPT_CHARS = 4000
MAX_IMAGES = 4
PROMPT_ERRORS = frozenset({400, 413, 422})
"""A text encoder's answers about the prompt, passed on; any other 4xx (its key refused, a route missing) is the
operator's problem, not the client's."""
SIZE = re.compile(r"([0-9]{1,5})x([0-9]{1,5})")
"""WIDTHxHEIGHT in ASCII digits (str.isdigit also takes "²", which int() refuses)."""


class ImagesBody(msgspec.Struct):
    """OpenAI's request, plus the diffusion settings Qwen-Image takes (unknown OpenAI fields are ignored)."""

    prompt: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PROMPT_CHARS)]
    model: Annotated[str, msgspec.Meta(max_length=MAX_ID)] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_IMAGES)] = 1
    size: Annotated[str, msgspec.Meta(max_length=16)] = "1024x1024"
    response_format: Literal["b64_json", "url"] = "b64_json"
    negative_prompt: Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)] | None = None
    num_inference_steps: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 50
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**62)] = 0
    true_cfg_scale: Annotated[float, msgspec.Meta(ge=0, le=100)] = 4.0


def parse_images_body(raw: bytes, urls: bool) -> tuple[ImagesBody, int, int]:
    """(body, width, height), every problem a 400 naming it; `urls`: whether response_format "url" is served."""
    body = parse_body(raw, ImagesBody)
    if body.response_format == "url" and not urls:
        raise ApiError(
            400,
            "response_format 'url' is not configured on this gateway (--image-urls); use 'b64_json'",
            param="response_format",
        )
    size = SIZE.fullmatch(body.size)
    if size is None:
        raise ApiError(400, f"size must be WIDTHxHEIGHT such as 1024x1024, got {body.size!r}", param="size")
    return body, int(size[1]), int(size[2])


class ImageGenerator:
    """Round-robin over the text encoders and the Geris; each call's errors answered in OpenAI's shape."""

    def __init__(
        self,
        text_encoder_urls: tuple[str, ...],
        geri_urls: tuple[str, ...],
        client: httpx.AsyncClient,
        text_encoder_key: str | None,
        geri_key: str | None,
        store: ImageStore | None = None,
        max_requests: int = 64,
    ) -> None:
        self.store = store
        self._max_requests = max_requests
        self._active = 0  # generations in progress: bounded, so they never take every pooled connection
        self._encoders = itertools.cycle(text_encoder_urls)
        self._geris = itertools.cycle(geri_urls)
        self._client = client
        self._encoder_headers = bearer(text_encoder_key)
        self._geri_headers = bearer(geri_key)

    async def generate(self, raw: bytes, base_url: str) -> dict:
        """OpenAI's answer: each image as b64_json, or (response_format "url") as a URL under `base_url`; a 503 while
        `max_requests` generations are in progress (the client retries after Retry-After)."""
        if self._active >= self._max_requests:
            raise ApiError(
                503, f"{self._active} image generations in progress (--max-image-requests); retry", retry_after=1.0
            )
        self._active += 1
        try:
            return await self._generate(raw, base_url)
        finally:
            self._active -= 1

    async def _generate(self, raw: bytes, base_url: str) -> dict:
        body, width, height = parse_images_body(raw, self.store is not None)
        use_negative = body.negative_prompt is not None and body.true_cfg_scale > 1
        prompt, negative = await all_or_none(
            self.hidden_states(body.prompt), self.hidden_states(body.negative_prompt) if use_negative else _none()
        )
        settings = {
            "height": height,
            "width": width,
            "steps": body.num_inference_steps,
            "guidance_scale": body.true_cfg_scale,
        }
        seeds = range(body.seed, body.seed + body.n)
        bodies = await asyncio.to_thread(  # base64 and JSON of megabytes of rows, per image: off the event loop
            lambda: [orjson.dumps(generate_body(prompt, negative, seed=seed, **settings)) for seed in seeds]
        )
        images = await all_or_none(*(self._image(b) for b in bodies))
        if body.response_format == "url" and self.store is not None:
            data = [{"url": f"{base_url}/v1/images/files/{self.store.put(png)}"} for png in images]
        else:
            data = [{"b64_json": base64.b64encode(png).decode()} for png in images]
        return {"created": int(time.time()), "data": data}

    async def hidden_states(self, prompt: str) -> np.ndarray:
        """The templated prompt's last hidden states [tokens, hidden] from vLLM, the template's own tokens dropped and
        at most MAX_PROMPT_TOKENS kept, as the pipeline keeps them. The text encoder is causal, so it is given only
        the tokens those rows see: a prompt of thousands of tokens (CJK, emoji) costs no more than one of 512."""
        url = next(self._encoders)
        tokens = await self._encoder_call(url, "/tokenize", {"prompt": PROMPT_TEMPLATE.format(prompt)})
        try:
            ids = msgspec.convert(tokens.json()["tokens"], list[int])[: TEMPLATE_TOKENS + MAX_PROMPT_TOKENS]
        except (ValueError, KeyError, TypeError, msgspec.ValidationError) as e:
            raise ApiError(502, f"text encoder answered unreadable tokens: {e!r}") from e
        pooled = await self._encoder_call(
            url, "/pooling", {"input": ids, "task": "token_embed", "use_activation": False}
        )
        states = await asyncio.to_thread(_states, pooled)  # megabytes of JSON numbers: off the event loop
        if states.ndim != 2 or states.shape[0] <= TEMPLATE_TOKENS:
            raise ApiError(502, f"text encoder answered hidden states of shape {list(states.shape)}")
        return states[TEMPLATE_TOKENS:]

    async def _encoder_call(self, url: str, path: str, payload: dict) -> httpx.Response:
        """The text encoder's 200 answer to POST `path`; its refusals of the prompt passed on, other failures 5xx."""
        try:
            response = await self._client.post(url + path, json=payload, headers=self._encoder_headers)
        except httpx.HTTPError as e:
            raise ApiError(503, f"text encoder {url} unreachable: {e!r}") from e
        if response.status_code in PROMPT_ERRORS:  # about the prompt
            # (e.g. longer than the text encoder's max_model_len): the client's to fix
            raise ApiError(
                response.status_code,
                f"the text encoder refused the prompt: {redact(_message(response))}",
                param="prompt",
            )
        if response.status_code != 200:  # a 5xx, or another 4xx
            raise ApiError(
                502 if response.status_code < 500 else 503,
                f"text encoder answered {response.status_code}: {response.text[:300]}",
            )
        return response

    async def _image(self, body: bytes) -> bytes:
        url = next(self._geris)
        headers = {**self._geri_headers, "content-type": "application/json"}
        try:
            response = await self._client.post(url + "/v1/generate", content=body, headers=headers)
        except httpx.TimeoutException as e:
            raise ApiError(504, f"image generator {url} timed out: {e!r}") from e
        except httpx.HTTPError as e:
            raise ApiError(503, f"image generator {url} unreachable: {e!r}") from e
        if response.status_code == 200:
            return response.content
        message = _message(response)
        status = response.status_code if response.status_code in (400, 503, 504) else 502
        raise ApiError(status, f"image generation failed: {message}")


def _states(response: httpx.Response) -> np.ndarray:
    """A pooling answer's float32 [tokens, hidden] states; 502 for one that is not."""
    try:
        return np.asarray(response.json()["data"][0]["data"], dtype=np.float32)
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ApiError(502, f"text encoder answered an unreadable pooling result: {e!r}") from e


def _message(response: httpx.Response) -> str:
    """An error answer's message: OpenAI's {"error": {"message"}}, vLLM's older {"message"}, else its text."""
    try:
        answer = response.json()
        message = answer["error"]["message"] if isinstance(answer.get("error"), dict) else answer["message"]
    except (ValueError, KeyError, TypeError, AttributeError):
        message = response.text
    return str(message)[:300]


async def _none() -> None:
    return None

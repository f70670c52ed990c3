"""The main job on one machine: the whole local EPD stack on the built-in tiny Qwen2-VL (Eric, vLLM with the Eric
plugin, the gateway), one multi-image chat request through the official openai client, and the answer.

Usage: python examples/local_demo.py        (CPU is enough; about a minute, most of it vLLM starting)
"""

from __future__ import annotations

import logging
import re
from contextlib import ExitStack

import httpx
import openai

from eric_epd.testing.checkpoints import ensure_checkpoint
from eric_epd.testing.media import image_data_url, video_data_url
from eric_epd.testing.server import EricServer
from eric_epd.testing.stack import GatewayServer, VllmServe


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    log = logging.getLogger("demo")
    model = ensure_checkpoint("qwen2_vl", "tiny")
    with ExitStack() as stack:
        log.info("starting Eric (encoder, TP 2) on %s", model)
        eric = stack.enter_context(EricServer(model, tp=2))
        log.info("starting vLLM with the Eric encoder-cache connector")
        vllm = stack.enter_context(VllmServe(model, eric_urls=[eric.url]))
        gateway = stack.enter_context(GatewayServer(None, "--encoder-urls", eric.url, "--colocated-urls", vllm.url))
        log.info("stack up: gateway %s -> Eric %s -> vLLM %s", gateway.url, eric.url, vllm.url)

        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none")
        content = [{"type": "image_url", "image_url": {"url": image_data_url(64 + 48 * i, 96, seed=i)}}
                   for i in range(3)]
        content.append({"type": "video_url", "video_url": {"url": video_data_url(8, 64, 48)}})
        content.append({"type": "text", "text": "What do these pictures and the clip have in common?"})
        raw = client.chat.completions.with_raw_response.create(
            model=client.models.list().data[0].id, messages=[{"role": "user", "content": content}],
            max_tokens=24, temperature=0.0)
        answer = raw.parse()
        log.info("path taken: %s (3 images + 1 video -> encoder, then prefill/decode)", raw.headers["x-epd-path"])
        log.info("answer (random tiny model, so words without meaning): %r", answer.choices[0].message.content)
        log.info("prompt tokens %d, completion tokens %d", answer.usage.prompt_tokens, answer.usage.completion_tokens)
        metrics = httpx.get(vllm.url + "/metrics").text
        loaded = re.search(r"^vllm:eric_ec_loaded_items_total\{.*\} (\S+)$", metrics, re.M)
        local = re.search(r"^vllm:eric_ec_local_encoder_items_total\{.*\} (\S+)$", metrics, re.M)
        log.info("vLLM loaded %s embeddings from Eric; its own vision encoder ran on %s items",
                 loaded.group(1) if loaded else "?", local.group(1) if local else "0")


if __name__ == "__main__":
    main()

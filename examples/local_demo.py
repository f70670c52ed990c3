"""The main job on one machine: start Eric on the built-in tiny Qwen2-VL, send a multi-image encode request,
fetch the embeddings over shared memory and print what came back.

Usage: python examples/local_demo.py
"""

from __future__ import annotations

import logging

import httpx

from eric_epd.testing.checkpoints import ensure_checkpoint
from eric_epd.testing.media import image_data_url, video_data_url
from eric_epd.testing.server import EricServer
from eric_epd.transfer.client import EmbeddingFetcher


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    log = logging.getLogger("demo")
    model = ensure_checkpoint("qwen2_vl", "tiny")
    log.info("starting Eric on %s", model)
    with EricServer(model, tp=2) as eric:
        items = [{"id": f"image-{i}", "modality": "image", "url": image_data_url(64 + 40 * i, 96, seed=i)}
                 for i in range(3)]
        items.append({"id": "clip", "modality": "video", "url": video_data_url(8, 64, 48)})
        resp = httpx.post(eric.url + "/v1/encode", json={"items": items}, timeout=120)
        resp.raise_for_status()
        fetcher = EmbeddingFetcher()
        for item in resp.json()["items"]:
            tensor = fetcher.fetch(item["handle"])
            log.info("%-8s %s grid %s -> %d tokens, embedding %s %s over %s, mean %+.4f", item["id"],
                     item["hash"][:12], item["grid_thw"], item["num_tokens"], tuple(tensor.shape), item["dtype"],
                     fetcher.last_backend, tensor.mean().item())
        log.info("pool after acks: %s", httpx.get(eric.url + "/v1/transfer").json())
        fetcher.close()


if __name__ == "__main__":
    main()

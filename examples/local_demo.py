"""The main job on one machine: `eric-epd up` starts the whole local EPD stack on the built-in tiny Qwen2-VL (Eric
on one half of the CPUs, vLLM with the Eric plugin on the other, the gateway), then one multi-image chat request
goes through the official openai client, and the stack is stopped with SIGTERM.

Usage: python examples/local_demo.py        (CPU is enough; about a minute, most of it vLLM starting)
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

from eric_epd.testing.media import image_data_url, video_data_url


def wait_for_url(ready: Path, proc: subprocess.Popen, timeout_s: float = 600) -> str:
    """The gateway URL `eric-epd up` writes to `ready` once the stack is up; raise if it exits or takes too long."""
    deadline = time.monotonic() + timeout_s
    while not ready.exists() or not ready.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"eric-epd up exited ({proc.returncode}) or did not come up in {timeout_s}s")
        time.sleep(0.5)
    return ready.read_text()


def ask(gateway: str) -> None:
    """Send one chat of three images and a video through the gateway and log the path it took and the answer."""
    log = logging.getLogger("demo")
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="none")  # `up` runs the gateway without a client key
    content = [{"type": "image_url", "image_url": {"url": image_data_url(64 + 48 * i, 96, seed=i)}} for i in range(3)]
    content.append({"type": "video_url", "video_url": {"url": video_data_url(8, 64, 48)}})
    content.append({"type": "text", "text": "What do these pictures and the clip have in common?"})
    raw = client.chat.completions.with_raw_response.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        max_tokens=24,
        temperature=0.0,
    )
    answer = raw.parse()
    log.info("path taken: %s (3 images + 1 video -> encoder, then prefill/decode)", raw.headers["x-epd-path"])
    log.info("answer (random tiny model, so words without meaning): %r", answer.choices[0].message.content)
    log.info("prompt tokens %d, completion tokens %d", answer.usage.prompt_tokens, answer.usage.completion_tokens)


def main() -> None:
    """Start `eric-epd up`, ask one question through it, then stop it with SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "gateway-url"
        up = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "eric_epd",
                "up",
                "--port",
                "8000",
                "--log-dir",
                str(Path(tmp) / "logs"),
                "--ready-file",
                str(ready),
            ]
        )
        try:
            ask(wait_for_url(ready, up))
        finally:
            up.send_signal(signal.SIGTERM)
            code = up.wait(120)
            logging.getLogger("demo").info("stack stopped (eric-epd up exited with %d)", code)


if __name__ == "__main__":
    main()

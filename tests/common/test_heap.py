"""keep_freed_heap: a process that keeps its freed heap reuses it for the next body of megabytes (no fresh page
faulted in), where glibc's defaults fault the pages of every such body in again (the control: a count of page faults,
not a time); each server's config refuses a negative amount."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eric_epd.runtime.config import RuntimeConfig

CHILD = """
import json, resource, sys, threading
import msgspec
from eric_epd.common.heap import keep_freed_heap
kept = keep_freed_heap(int(sys.argv[1]))
text = json.dumps({"items": [{"url": "data:" + "QUJD" * 900_000} for _ in range(3)]}).encode()
chunks = [text[i : i + 262144] for i in range(0, len(text), 262144)]
def request():  # as Eric's router takes a body inlining three 1024 px PNGs: joined, then decoded and hashed in a thread
    body = b"".join(chunks)
    out = []
    urls = lambda: out.append([i["url"].encode() for i in msgspec.json.decode(body)["items"]])
    decode = threading.Thread(target=urls)
    decode.start()
    decode.join()
request()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    request()
print(kept, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10, len(text) // 4096)
"""


def _faults_per_body(keep_bytes: int) -> tuple[bool, float, int]:
    """(whether the heap is kept, minor page faults per request, the body's pages) in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(keep_bytes)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    ).stdout.split()
    return out[0] == "True", float(out[1]), int(out[2])


def test_a_kept_heap_reuses_freed_bodies_where_the_defaults_fault_them_in_again() -> None:
    kept, faults, pages = _faults_per_body(256 * 2**20)
    assert kept and faults < pages / 20, (faults, pages)
    kept, faults, pages = _faults_per_body(0)  # the control: glibc's defaults
    assert not kept and faults > pages / 2, (faults, pages)


@pytest.mark.parametrize("keep", [-1, 1, 2**20 - 1])
def test_a_negative_or_tiny_amount_is_refused(keep: int) -> None:
    with pytest.raises(ValueError, match="heap_keep_bytes"):
        RuntimeConfig(model=Path("m"), heap_keep_bytes=keep)
    assert RuntimeConfig(model=Path("m"), heap_keep_bytes=0).heap_keep_bytes == 0

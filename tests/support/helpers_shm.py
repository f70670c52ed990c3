"""Shared by the shm_broadcast tests: this process's segment names and a check that none leaks, reader processes
(spawn) started and reaped around each test."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:  # a checkout without `pip install -e .`; spawned children inherit sys.path
    sys.path.insert(0, ROOT)

CTX = mp.get_context("spawn")
SHM_DIR = Path("/dev/shm")
PREFIX = f"ebc_{os.getpid():x}_"  # default names of every segment this (writer) process creates


def segments() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(PREFIX)}


@pytest.fixture(autouse=True)
def no_leaked_segments():
    before = segments()
    yield
    assert segments() - before == set(), "shared memory segments leaked"


@pytest.fixture
def procs():
    started: list = []
    yield started
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(5)


def start(procs: list, target, *args) -> None:
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    procs.append(p)


def any_dead(procs: list):
    return lambda: not all(p.is_alive() for p in procs)

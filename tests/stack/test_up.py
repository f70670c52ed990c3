"""`eric-epd up`: the whole local stack on disjoint CPUs answers a multi-image chat request through the openai
client on the EPD path, refuses media that redirect into the host's loopback on both paths (no test allowance in what
users run), and SIGTERM stops every process it started and removes their ipc directories."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from eric_epd.eric.config import EricConfig
from eric_epd.stack.process import free_port
from eric_epd.testing.media import image_data_url
from eric_epd.testing.stack import image_messages
from tests.support.netns import LoopbackListener, public_redirector


def _wait_ready(ready: Path, proc: subprocess.Popen, timeout_s: float = 600) -> str:
    deadline = time.monotonic() + timeout_s
    while not (ready.exists() and ready.read_text()):
        assert proc.poll() is None, f"eric-epd up exited with {proc.returncode}"
        assert time.monotonic() < deadline, "eric-epd up did not come up"
        time.sleep(0.5)
    return ready.read_text()


def _cpus_by_role(root: psutil.Process) -> dict[str, set[int]]:
    """CPUs of every process of the Eric server (router, engine, workers) and of the vLLM server (API server,
    engine core, workers) that `up` started."""
    roles: dict[str, set[int]] = {"eric": set(), "vllm": set()}
    for server in root.children():
        cmd = " ".join(server.cmdline())
        role = "eric" if "eric_epd serve" in cmd else "vllm" if " serve " in cmd and "vllm" in cmd else None
        if role is not None:
            for p in (server, *server.children(recursive=True)):
                roles[role] |= set(p.cpu_affinity())
    return roles


def _eric_ipc_dirs(root: psutil.Process) -> set[Path]:
    """Directories of the unix sockets the Eric server's processes (router, engine, workers) have open."""
    dirs: set[Path] = set()
    for server in root.children():
        if "eric_epd serve" in " ".join(server.cmdline()):
            for p in (server, *server.children(recursive=True)):
                dirs |= {Path(c.laddr).parent for c in p.net_connections(kind="unix") if c.laddr}
    return dirs


def _no_loopback_by_redirect(client: openai.OpenAI, images: list[str]) -> None:
    """A public origin (an address of a network namespace made here) answering 302 to a loopback port: refused with a
    400 on the EPD path (Eric fetches it) and on the plain path (the gateway does), and the port is never reached."""
    listener = LoopbackListener()
    model = client.models.list().data[0].id
    try:
        with public_redirector(f"http://127.0.0.1:{listener.port}/secret.png") as origin:
            for path, urls in (("epd", [*images[:2], f"{origin}/a.png"]), ("plain", [f"{origin}/b.png"])):
                with pytest.raises(openai.BadRequestError) as e:
                    client.chat.completions.create(model=model, messages=image_messages(urls), max_tokens=2)
                assert "127.0.0.1" in str(e.value) and "refused" in str(e.value), (path, e.value)
    finally:
        listener.close()
    assert listener.accepted == 0


def _metrics_by_the_written_key(url: str, key_file: Path) -> None:
    """`up` generated the gateway's /metrics key into a file only its owner reads; the key opens /metrics, no key
    does not."""
    assert key_file.stat().st_mode & 0o777 == 0o600
    key = key_file.read_text()
    assert httpx.get(url + "/metrics").status_code == 401
    answer = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200 and "gateway_requests_total" in answer.text


def test_a_config_alone_creates_no_directory() -> None:
    config = EricConfig(model=Path("."))
    assert config.run_dir.name.startswith("eric-") and not config.run_dir.exists()
    assert EricConfig(model=Path(".")).run_dir != config.run_dir


@pytest.mark.parametrize("family", ["qwen2_vl_tiny"])
def test_up_serves_a_multi_image_chat_and_stops_cleanly(
    family: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The built-in family. (`up` composes the same launchers that tests/gateway/test_gateway_qwen3.py runs for the
    Qwen3-VL and Qwen3.5 families: the suite keeps one `up` run to stay within its time.)"""
    model: Path = request.getfixturevalue(family)
    ready, port = tmp_path / "url", free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eric_epd",
            "up",
            "--model",
            str(model),
            "--port",
            str(port),
            "--log-dir",
            str(tmp_path / "logs"),
            "--ready-file",
            str(ready),
        ]
    )
    try:
        url = _wait_ready(ready, proc)
        assert url == f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        images = [image_data_url(64 + 16 * i, 80, seed=900 + i) for i in range(3)]
        raw = client.chat.completions.with_raw_response.create(
            model=client.models.list().data[0].id,
            messages=image_messages(images),
            max_tokens=6,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert raw.headers["x-epd-path"] == "epd"
        assert raw.parse().usage.completion_tokens == 6
        _no_loopback_by_redirect(client, images)
        _metrics_by_the_written_key(url, tmp_path / "logs" / "metrics.key")
        roles = _cpus_by_role(psutil.Process(proc.pid))
        assert roles["eric"] and roles["vllm"]
        if psutil.cpu_count() > 1:
            assert not roles["eric"] & roles["vllm"], roles  # no two thread pools on one core
        children = psutil.Process(proc.pid).children(recursive=True)
        ipc_dirs = _eric_ipc_dirs(psutil.Process(proc.pid))
        assert ipc_dirs and all(d.name.startswith("eric-") for d in ipc_dirs), ipc_dirs
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(180)
    assert code == 0
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.pid for p in alive]
    assert not [d for d in ipc_dirs if d.exists()]

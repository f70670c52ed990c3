"""Cross-object wiring of a rendered deploy/kubernetes overlay: each check takes the overlay's objects and returns its
problems (an empty list: none), so tests can run it on the manifests as they are and on mutated copies."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

from tests.deploy.manifests import (
    config_maps,
    containers,
    eric_parser,
    expand,
    expanded_args,
    selects,
    variables,
    vllm_parser,
    workloads,
)

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
URL = re.compile(r"\b(?P<scheme>https?)://(?P<host>[a-z0-9](?:[-a-z0-9.]*[a-z0-9])?\.?)(?::(?P<port>\d+))?", re.I)
HOST_PORT = re.compile(r"(?<![\w.:/-])(?P<host>[a-z0-9](?:[-a-z0-9.]*[a-z0-9])?\.?):(?P<port>\d+)\b", re.I)
DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class Ref:
    """A DNS name and port a container is given (in an argument, a variable or a ConfigMap it loads)."""

    where: str
    host: str
    port: int
    domain: str  # the cluster domain the container's config names (EPD_CLUSTER_DOMAIN), cluster.local by default


def name_of(o: dict) -> str:
    return f"{o['kind']} {o['metadata']['name']}"


def of_kind(objs: Sequence[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def template_labels(w: dict) -> dict:
    return w["spec"]["template"]["metadata"].get("labels", {})


def argv(objs: Sequence[dict], c: dict) -> list[str]:
    """The container's command line with $(VAR) filled in."""
    return [expand(x, variables(objs, c)) for x in c.get("command", [])] + expanded_args(objs, c)


@cache
def mooncake_master_defaults() -> dict[str, str]:
    """The master's flag defaults, read from its own --helpmatch (gflags) output."""
    binary = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    done = subprocess.run([binary, "--helpmatch=master"], capture_output=True, text=True, timeout=60)
    text = " ".join((done.stdout + done.stderr).split())
    flags = dict(re.findall(r"-(\w+) \(.*?\) type: \w+ default: \"?([^\s\"]*)\"?", text))
    assert {"port", "rpc_port", "metrics_port", "enable_http_metadata_server"} <= set(flags), text[:300]
    return flags


def listening_ports(objs: Sequence[dict], c: dict) -> set[int] | None:
    """The ports the container's server listens on, from its command line as that server's own parser reads it; None
    for a command no parser here knows (then its containerPorts are taken at their word)."""
    line = argv(objs, c)
    if line[0] == "eric-epd" and line[1:2] in (["serve"], ["geri"]):
        return {eric_parser().parse_args(line[1:]).port}
    if line[0] == "epd-gateway":
        from epd_gateway.config import parse_args as gateway_args

        return {gateway_args(line[1:]).port}
    if line[0] == "vllm" and line[1:2] == ["serve"]:
        return {vllm_parser().parse_args(line[2:]).port}
    if line[0] == "mooncake_master":  # gflags: -name=value or --name=value
        flags = mooncake_master_defaults() | dict(re.findall(r"^--?(\w+)=(.*)$", "\n".join(line[1:]), re.M))
        ports = {int(flags["rpc_port"]) or int(flags["port"]), int(flags["metrics_port"])}
        if flags["enable_http_metadata_server"] == "true":
            ports.add(int(flags["http_metadata_server_port"]))
        return ports
    return None


def container_port(c: dict, port: int | str, protocol: str = "TCP") -> int | None:
    """The number of the container's port `port` (a number or a port name) of this protocol, if it declares one."""
    for p in c.get("ports", []):
        if p.get("protocol", "TCP") == protocol and (p["containerPort"] == port or p.get("name") == port):
            return p["containerPort"]
    return None


def served(objs: Sequence[dict], w: dict, c: dict, number: int, what: str) -> list[str]:
    """A problem if the container's server does not listen on `number`."""
    ports = listening_ports(objs, c)
    if ports is None or number in ports:
        return []
    return [f"{what} reaches {name_of(w)} container {c['name']} on {number}, but its server listens on {sorted(ports)}"]


def check_workload_selectors(objs: Sequence[dict]) -> list[str]:
    """Every Deployment/StatefulSet's spec.selector is non-empty and selects its own pod template (the API server
    rejects it otherwise), and no other workload's template (controllers would fight over those pods)."""
    problems = []
    for w in workloads(objs):
        selector = w["spec"].get("selector") or {}
        if not selector.get("matchLabels") and not selector.get("matchExpressions"):
            problems.append(f"{name_of(w)}: empty spec.selector")
        elif not selects(selector, template_labels(w)):
            problems.append(f"{name_of(w)}: spec.selector {selector} does not match its template's labels")
        else:
            problems += [
                f"{name_of(w)}: spec.selector also selects {name_of(other)}'s pods"
                for other in workloads(objs)
                if other is not w and selects(selector, template_labels(other))
            ]
    return problems


def selected_pods(objs: Sequence[dict], svc: dict) -> list[dict]:
    selector = svc["spec"].get("selector") or {}
    return [w for w in workloads(objs) if selector and selects({"matchLabels": selector}, template_labels(w))]


def reach(objs: Sequence[dict], svc: dict, port: dict, direct: bool = False) -> list[str]:
    """Problems on the way from one port of a Service to a server: it selects some pod template, in each its targetPort
    (a number or a port name) is a containerPort of the same protocol, and that container's server listens there.
    `direct`: the client connects to the pods on the Service's port itself (a headless Service's name resolves to
    the pods' addresses), so the targetPort must be that same number."""
    what = f"Service {svc['metadata']['name']} port {port['port']}"
    target, protocol = port.get("targetPort", port["port"]), port.get("protocol", "TCP")
    pods = selected_pods(objs, svc)
    problems = [] if pods else [f"{what}: selector {svc['spec'].get('selector')} selects no workload's pods"]
    for w in pods:
        found = [
            (c, n) for c in w["spec"]["template"]["spec"]["containers"] if (n := container_port(c, target, protocol))
        ]
        if not found:
            problems.append(f"{what}: targetPort {target!r} is no {protocol} containerPort of {name_of(w)}")
        for c, number in found:
            problems += served(objs, w, c, number, what)
            if direct and number != port["port"]:
                problems.append(f"{what} is headless, so clients reach {name_of(w)} on {port['port']}, not {number}")
    return problems


def check_services(objs: Sequence[dict]) -> list[str]:
    """Every Service selects at least one workload's pod template, and each of its ports reaches a listening server."""
    return [p for svc in of_kind(objs, "Service") for port in svc["spec"]["ports"] for p in reach(objs, svc, port)]


def check_probes(objs: Sequence[dict]) -> list[str]:
    """Every probe's port (httpGet, tcpSocket, grpc; a number or a port name) is a containerPort of its own container,
    one its server listens on."""
    problems = []
    for w in workloads(objs):
        for c in containers(w):
            for kind in PROBES:
                for handler in ("httpGet", "tcpSocket", "grpc"):
                    if handler not in c.get(kind, {}):
                        continue
                    port = c[kind][handler]["port"]
                    what = f"{name_of(w)} container {c['name']} {kind} port {port!r}"
                    number = container_port(c, port)
                    if number is None:
                        problems.append(f"{what} is no containerPort of the container")
                    else:
                        problems += served(objs, w, c, number, what)
    return problems


def references(objs: Sequence[dict]) -> list[Ref]:
    """Every URL and NAME:PORT in the containers' command lines, variables and the ConfigMaps they load."""
    refs = []
    for w in workloads(objs):
        for c in containers(w):
            env = variables(objs, c)
            domain = env.get("EPD_CLUSTER_DOMAIN", "cluster.local")
            texts = [("args", a) for a in argv(objs, c)]
            texts += [(f"env {e['name']}", env[e["name"]]) for e in c.get("env", []) if "value" in e]
            texts += [(f"{name_of(m)} {k}", v) for m in config_maps(objs, c) for k, v in m.get("data", {}).items()]
            for source, text in texts:
                where = f"{name_of(w)} container {c['name']} {source}"
                for m in URL.finditer(text):
                    port = int(m["port"]) if m["port"] else DEFAULT_PORTS[m["scheme"].lower()]
                    refs.append(Ref(where, m["host"].lower(), port, domain))
                for m in HOST_PORT.finditer(URL.sub("", text)):
                    refs.append(Ref(where, m["host"].lower(), int(m["port"]), domain))
    return refs


def check_references(objs: Sequence[dict]) -> list[str]:
    """Every DNS name and port a container is given names a Service of the overlay (its short name, NAME.NAMESPACE,
    NAME.NAMESPACE.svc or the absolute NAME.NAMESPACE.svc.DOMAIN.) with that port, which reaches a server listening on
    it (on that very port where the Service is headless)."""
    problems = []
    for ref in references(objs):
        name, *rest = ref.host.rstrip(".").split(".")
        svc = next((s for s in of_kind(objs, "Service") if s["metadata"]["name"] == name), None)
        what = f"{ref.where}: {ref.host}:{ref.port}"
        if svc is None:
            problems.append(f"{what} names no Service")
            continue
        full = [svc["metadata"]["namespace"], "svc", *ref.domain.split(".")]
        if rest not in ([], full[:1], full[:2], full) or (ref.host.endswith(".") and rest != full):
            problems.append(f"{what} is not a name of {name_of(svc)} (absolute: {'.'.join([name, *full])}.)")
            continue
        port = next((p for p in svc["spec"]["ports"] if p["port"] == ref.port), None)
        if port is None:
            problems.append(f"{what}: {name_of(svc)} has no port {ref.port}")
            continue
        problems += [f"{what}: {p}" for p in reach(objs, svc, port, direct=svc["spec"].get("clusterIP") == "None")]
    return problems


def check_stateful_sets(objs: Sequence[dict]) -> list[str]:
    """Every StatefulSet's serviceName is a headless Service of the overlay that selects its pods."""
    problems = []
    for s in of_kind(objs, "StatefulSet"):
        name = s["spec"].get("serviceName")
        svc = next((o for o in of_kind(objs, "Service") if o["metadata"]["name"] == name), None)
        if svc is None:
            problems.append(f"{name_of(s)}: serviceName {name!r} is no Service")
        elif svc["spec"].get("clusterIP") != "None":
            problems.append(f"{name_of(s)}: serviceName {name} is not headless (clusterIP: None is what makes it so)")
        elif s not in selected_pods(objs, svc):
            problems.append(f"{name_of(s)}: its Service {name} does not select its pods")
    return problems


def check_other_references(objs: Sequence[dict]) -> list[str]:
    """PodDisruptionBudgets select some workload's pods, ServiceMonitors select Services and name their ports, and
    HorizontalPodAutoscalers scale a workload of the overlay."""
    problems = []
    for pdb in of_kind(objs, "PodDisruptionBudget"):
        if not any(selects(pdb["spec"]["selector"], template_labels(w)) for w in workloads(objs)):
            problems.append(f"{name_of(pdb)}: selector selects no workload's pods")
    for monitor in of_kind(objs, "ServiceMonitor"):
        services = [
            s for s in of_kind(objs, "Service") if selects(monitor["spec"]["selector"], s["metadata"]["labels"])
        ]
        if not services:
            problems.append(f"{name_of(monitor)}: selector selects no Service")
        for endpoint in monitor["spec"]["endpoints"]:
            problems += [
                f"{name_of(monitor)}: {name_of(s)} has no port named {endpoint['port']!r}"
                for s in services
                if endpoint["port"] not in {p.get("name") for p in s["spec"]["ports"]}
            ]
    for hpa in of_kind(objs, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        if not any(w["kind"] == ref["kind"] and w["metadata"]["name"] == ref["name"] for w in workloads(objs)):
            problems.append(f"{name_of(hpa)}: scaleTargetRef {ref['kind']} {ref['name']} is not in the overlay")
    return problems


CHECKS = (
    check_workload_selectors,
    check_services,
    check_probes,
    check_references,
    check_stateful_sets,
    check_other_references,
)


def parsed_targets(objs: Sequence[dict]) -> set[tuple[str, int]]:
    """The (name, port)s the servers themselves take from their configuration: the gateway's Erics, engines, Geris
    and text encoders, the vLLM connector's Erics, Eric's global cache. references() must find each of them."""
    from epd_gateway.config import parse_args as gateway_args

    from eric_epd.plugins.vllm.settings import EricConnectorSettings

    def url(u: str) -> tuple[str, int]:
        parts = urlsplit(u)
        return parts.hostname or "", parts.port or DEFAULT_PORTS[parts.scheme]

    found: set[tuple[str, int]] = set()
    for w in workloads(objs):
        for c in containers(w):
            line = argv(objs, c)
            if line[0] == "epd-gateway":
                g = gateway_args(line[1:])
                found |= {(t.name, t.port) for t in g.encoder_dns}
                urls = (g.encoder_urls, g.prefill_urls, g.decode_urls, g.colocated_urls, g.geri_urls)
                found |= {url(u) for us in (*urls, g.text_encoder_urls) for u in us}
            elif line[:2] == ["eric-epd", "serve"] and (cache_at := eric_parser().parse_args(line[1:]).global_cache):
                host, _, port = cache_at.rpartition(":")
                found.add((host.lower(), int(port)))
            elif line[:2] == ["vllm", "serve"]:
                config = vllm_parser().parse_args(line[2:]).ec_transfer_config
                if config is not None:
                    s = EricConnectorSettings.parse(config.ec_connector_extra_config, environ={})
                    found |= {(t.name, t.port) for t in s.eric_dns} | {url(u) for u in s.eric_urls}
    return found

"""deploy/kubernetes' cross-object wiring (tests/deploy/wiring.py) over every overlay: none of its checks finds a
problem in the manifests as they are, and each reports the mistake it exists for when a copy is mutated to have it."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tests.deploy import wiring
from tests.deploy.manifests import OVERLAYS, render

GATEWAY_ERIC = "eric.eric-epd.svc.cluster.local."
CONNECTOR_ERIC = "eric-headless.eric-epd.svc.cluster.local."
MONITORED = ("gpu", "gpu+geri")  # the overlays with the monitoring component (ServiceMonitors, the HPA)


def at(objs: list[dict], kind: str, name: str) -> dict:
    """The one object of this kind and name (a generated ConfigMap by its name before the hash)."""
    found = [
        o
        for o in objs
        if o["kind"] == kind
        and (o["metadata"]["name"] == name or (kind == "ConfigMap" and o["metadata"]["name"].startswith(f"{name}-")))
    ]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def put(objs: list[dict], kind: str, name: str, path: tuple, value: object) -> None:
    """Set the value at `path` (keys and list indexes) of the object to a different one."""
    o = at(objs, kind, name)
    for key in path[:-1]:
        o = o[key]
    assert o[path[-1]] != value, (kind, name, path)
    o[path[-1]] = value


def sub(objs: list[dict], kind: str, name: str, old: str, new: str) -> None:
    """Replace `old` by `new` where it occurs in the object's strings: exactly one of them holds it, once."""
    o = at(objs, kind, name)
    text = json.dumps(o)
    assert json.dumps(old)[1:-1] in text and text.count(json.dumps(old)[1:-1]) == 1, (kind, name, old)
    o.clear()
    o.update(json.loads(text.replace(json.dumps(old)[1:-1], json.dumps(new)[1:-1])))


NAME = "app.kubernetes.io/name"
CONTAINER0 = ("spec", "template", "spec", "containers", 0)


@dataclass(frozen=True)
class Mutation:
    """A mistake made in a copy of the overlay's objects, the check that must report it and words its report has."""

    id: str
    apply: Callable[[list[dict]], None]
    check: Callable[[list[dict]], list[str]]
    says: str
    overlays: tuple[str, ...] = OVERLAYS


MUTATIONS = (
    Mutation(
        "service-selector-typo",
        lambda o: put(o, "Service", "vllm-prefill", ("spec", "selector", NAME), "vllm-prefil"),
        wiring.check_services,
        "Service vllm-prefill port 8000: selector {'app.kubernetes.io/name': 'vllm-prefil'} selects no workload's pods",
    ),
    Mutation(
        "referenced-service-selects-nothing",
        lambda o: put(o, "Service", "eric", ("spec", "selector", NAME), "erik"),
        wiring.check_references,
        f"Deployment gateway container gateway args: {GATEWAY_ERIC}:8100: Service eric port 8100: selector "
        "{'app.kubernetes.io/name': 'erik'} selects no workload's pods",
    ),
    Mutation(
        "target-port-names-no-port",
        lambda o: put(o, "Service", "vllm-decode", ("spec", "ports", 0, "targetPort"), "htp"),
        wiring.check_services,
        "Service vllm-decode port 8000: targetPort 'htp' is no TCP containerPort of Deployment vllm-decode",
    ),
    Mutation(
        "target-port-number-no-port",
        lambda o: put(o, "Service", "gateway", ("spec", "ports", 0, "targetPort"), 8080),
        wiring.check_services,
        "Service gateway port 8000: targetPort 8080 is no TCP containerPort of Deployment gateway",
    ),
    Mutation(
        "deployment-selector-misses-its-template",
        lambda o: put(o, "Deployment", "gateway", ("spec", "selector", "matchLabels", NAME), "gatway"),
        wiring.check_workload_selectors,
        "Deployment gateway: spec.selector {'matchLabels': {'app.kubernetes.io/name': 'gatway'}} does not match",
    ),
    Mutation(
        "deployment-selector-takes-another-workloads-pods",
        lambda o: put(
            o,
            "Deployment",
            "vllm-decode",
            ("spec", "selector"),
            {"matchLabels": {"app.kubernetes.io/component": "engine"}},
        ),
        wiring.check_workload_selectors,
        "Deployment vllm-decode: spec.selector also selects Deployment vllm-prefill's pods",
    ),
    Mutation(
        "gateway-encoder-dns-port-off-by-one",
        lambda o: sub(o, "Deployment", "gateway", ".svc.cluster.local.:8100", ".svc.cluster.local.:8101"),
        wiring.check_references,
        f"Deployment gateway container gateway args: {GATEWAY_ERIC}:8101: Service eric has no port 8101",
    ),
    Mutation(
        "connector-eric-dns-port-off-by-one",
        lambda o: sub(o, "ConfigMap", "epd-config", f"{CONNECTOR_ERIC}:8100", f"{CONNECTOR_ERIC}:8101"),
        wiring.check_references,
        f"{CONNECTOR_ERIC}:8101: Service eric-headless has no port 8101",
    ),
    Mutation(
        "eric-listens-on-another-port",
        lambda o: sub(o, "StatefulSet", "eric", "--port=8100", "--port=8101"),
        wiring.check_references,
        f"{GATEWAY_ERIC}:8100: Service eric port 8100 reaches StatefulSet eric container eric on 8100, but its server "
        "listens on [8101]",
    ),
    Mutation(
        "headless-service-target-port-moved",
        lambda o: (
            sub(o, "StatefulSet", "eric", "--port=8100", "--port=8101"),
            put(o, "StatefulSet", "eric", (*CONTAINER0, "ports", 0, "containerPort"), 8101),
        ),
        wiring.check_references,
        f"{GATEWAY_ERIC}:8100: Service eric port 8100 is headless, so clients reach StatefulSet eric on 8100, not 8101",
    ),
    Mutation(
        "store-master-listens-on-another-port",
        lambda o: sub(o, "Deployment", "epd-store", "--rpc_port=50051", "--rpc_port=50052"),
        wiring.check_services,
        "Service epd-store port 50051 reaches Deployment epd-store container master on 50051, but its server listens "
        "on [9003, 50052]",
    ),
    Mutation(
        "url-names-no-service",
        lambda o: sub(o, "Deployment", "gateway", "http://vllm-prefill:8000", "http://vllm-prefil:8000"),
        wiring.check_references,
        "Deployment gateway container gateway args: vllm-prefil:8000 names no Service",
    ),
    Mutation(
        "dns-name-in-another-cluster-domain",
        lambda o: sub(o, "Deployment", "gateway", ".svc.cluster.local.:8100", ".svc.cluster.lcoal.:8100"),
        wiring.check_references,
        f"eric.eric-epd.svc.cluster.lcoal.:8100 is not a name of Service eric (absolute: {GATEWAY_ERIC})",
    ),
    Mutation(
        "probe-port-names-no-port",
        lambda o: put(o, "StatefulSet", "eric", (*CONTAINER0, "readinessProbe", "httpGet", "port"), "htp"),
        wiring.check_probes,
        "StatefulSet eric container eric readinessProbe port 'htp' is no containerPort of the container",
    ),
    Mutation(
        "probe-port-number-off-by-one",
        lambda o: put(o, "Deployment", "gateway", (*CONTAINER0, "livenessProbe", "httpGet", "port"), 8001),
        wiring.check_probes,
        "Deployment gateway container gateway livenessProbe port 8001 is no containerPort of the container",
    ),
    Mutation(
        "stateful-set-service-name-typo",
        lambda o: put(o, "StatefulSet", "eric", ("spec", "serviceName"), "eric-headles"),
        wiring.check_stateful_sets,
        "StatefulSet eric: serviceName 'eric-headles' is no Service",
    ),
    Mutation(
        "stateful-set-service-not-headless",
        lambda o: put(o, "Service", "eric-headless", ("spec", "clusterIP"), "10.96.0.10"),
        wiring.check_stateful_sets,
        "StatefulSet eric: serviceName eric-headless is not headless",
    ),
    Mutation(
        "disruption-budget-selector-typo",
        lambda o: put(o, "PodDisruptionBudget", "gateway", ("spec", "selector", "matchLabels", NAME), "gatway"),
        wiring.check_other_references,
        "PodDisruptionBudget gateway: selector selects no workload's pods",
    ),
    Mutation(
        "service-monitor-port-typo",
        lambda o: put(o, "ServiceMonitor", "eric", ("spec", "endpoints", 0, "port"), "metrics"),
        wiring.check_other_references,
        "ServiceMonitor eric: Service eric has no port named 'metrics'",
        MONITORED,
    ),
    Mutation(
        "autoscaler-target-typo",
        lambda o: put(o, "HorizontalPodAutoscaler", "eric", ("spec", "scaleTargetRef", "name"), "erik"),
        wiring.check_other_references,
        "HorizontalPodAutoscaler eric: scaleTargetRef StatefulSet erik is not in the overlay",
        MONITORED,
    ),
)
CASES = [(m, overlay) for m in MUTATIONS for overlay in m.overlays]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_manifests_have_no_wiring_problems(overlay: str) -> None:
    objs = render(overlay)
    assert {check.__name__: check(objs) for check in wiring.CHECKS} == {check.__name__: [] for check in wiring.CHECKS}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_references_checked_include_every_target_the_servers_parse(overlay: str) -> None:
    """What the gateway, the connector and Eric take from their configuration (parsed by their own parsers) is among
    the names and ports references() finds and check_references() follows, so none escapes the check."""
    objs = render(overlay)
    parsed = wiring.parsed_targets(objs)
    assert parsed <= {(r.host, r.port) for r in wiring.references(objs)}
    geri = {("geri", 8200), ("text-encoder", 8000)} if overlay == "gpu+geri" else set()
    assert (
        parsed
        == {
            (GATEWAY_ERIC, 8100),
            (CONNECTOR_ERIC, 8100),
            ("vllm-prefill", 8000),
            ("vllm-decode", 8000),
            ("epd-store", 50051),
        }
        | geri
    )


@pytest.mark.parametrize(("mutation", "overlay"), CASES, ids=[f"{m.id}-{overlay}" for m, overlay in CASES])
def test_each_check_reports_its_mutation(mutation: Mutation, overlay: str) -> None:
    objs = copy.deepcopy(list(render(overlay)))
    assert mutation.check(objs) == []
    mutation.apply(objs)
    problems = mutation.check(objs)
    assert any(mutation.says in p for p in problems), problems
    assert objs != list(render(overlay))  # the rendered objects themselves are untouched

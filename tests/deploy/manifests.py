"""Rendering k8s/ overlays offline, and reading what the tests check.

Rendering uses `kubectl kustomize` when kubectl is on PATH; otherwise a small
built-in renderer assembles the same objects from the kustomize features the
manifests use (resources, strategic-merge patches with `$patch: delete` and
null deletes, nameSuffix with the name references it rewrites, labels with
includeSelectors, images, namespace). When kubectl is present,
test_deploy_k8s.py compares the two renderings, so the fallback stays honest.

A helper module, not a test module: the deploy tests import it (pytest puts
this folder on sys.path).
"""

from __future__ import annotations

import argparse
import copy
import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
K8S_VERSION = "1.30.0"
KUBECTL = shutil.which("kubectl")

Obj = dict[str, Any]

CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "StorageClass",
                  "PersistentVolume", "CustomResourceDefinition"}
# Strategic-merge keys of the list fields the manifests patch.
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
    "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name",
}
# Where kustomize's `labels: includeSelectors: true` writes (its commonLabels
# field specs), for the kinds k8s/ ships: (kind, path, create-if-missing).
# "[]" steps into every list item.
SELECTOR_LABEL_FIELDS: list[tuple[str, str, bool]] = [
    ("Service", "spec.selector", True),
    ("Deployment", "spec.selector.matchLabels", True),
    ("Deployment", "spec.template.metadata.labels", True),
    ("Deployment", "spec.template.spec.topologySpreadConstraints[].labelSelector.matchLabels", False),
    ("Job", "spec.selector.matchLabels", False),
    ("Job", "spec.template.metadata.labels", True),
    ("PodDisruptionBudget", "spec.selector.matchLabels", False),
    ("NetworkPolicy", "spec.podSelector.matchLabels", False),
    ("NetworkPolicy", "spec.ingress[].from[].podSelector.matchLabels", False),
    ("NetworkPolicy", "spec.egress[].to[].podSelector.matchLabels", False),
]
# Fields that name another object; nameSuffix rewrites them when that object
# is part of the same build: (kind holding the field, path, referenced kind).
NAME_REFERENCES: list[tuple[str, str, str]] = [
    (kind, path, ref)
    for kind in ("Deployment", "Job")
    for path, ref in [
        ("spec.template.spec.serviceAccountName", "ServiceAccount"),
        ("spec.template.spec.volumes[].persistentVolumeClaim.claimName", "PersistentVolumeClaim"),
        ("spec.template.spec.volumes[].secret.secretName", "Secret"),
        ("spec.template.spec.volumes[].configMap.name", "ConfigMap"),
        ("spec.template.spec.containers[].env[].valueFrom.secretKeyRef.name", "Secret"),
    ]
] + [("HorizontalPodAutoscaler", "spec.scaleTargetRef.name", "Deployment")]


# ------------------------------------------------------------ the fallback renderer


def _load_all(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _merge(base: Obj, patch: Obj) -> None:
    """Strategic merge of ``patch`` into ``base`` (the subset kustomize applies here)."""
    for key, value in patch.items():
        if key == "$patch":
            continue
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(base.get(key), list):
            mk = MERGE_KEYS[key]
            items = base[key]
            for item in value:
                idx = next((i for i, b in enumerate(items) if b.get(mk) == item.get(mk)), None)
                if item.get("$patch") == "delete":
                    if idx is not None:
                        items.pop(idx)
                elif idx is not None:
                    _merge(items[idx], item)
                else:
                    items.append({k: v for k, v in copy.deepcopy(item).items() if k != "$patch"})
        else:
            base[key] = copy.deepcopy(value)


def _walk(node: Any, steps: list[str], create: bool) -> list[Any]:
    """Containers at the end of a dotted path; "[]" steps into list items."""
    if not steps:
        return [node]
    step, rest = steps[0], steps[1:]
    if step.endswith("[]"):
        items = node.get(step[:-2]) if isinstance(node, dict) else None
        return [found for item in (items or []) for found in _walk(item, rest, create)]
    if not isinstance(node, dict):
        return []
    if step not in node:
        if not create:
            return []
        node[step] = {}
    return _walk(node[step], rest, create)


def _path_values(obj: Obj, path: str) -> list[tuple[dict[str, Any], str]]:
    """(parent dict, key) of every string at ``path`` in ``obj``."""
    *head, last = path.split(".")
    return [(parent, last) for parent in _walk(obj, head, False)
            if isinstance(parent, dict) and isinstance(parent.get(last), str)]


def _add_labels(objs: list[Obj], pairs: dict[str, str], selectors: bool) -> None:
    for obj in objs:
        obj.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
        if not selectors:
            continue
        for kind, path, create in SELECTOR_LABEL_FIELDS:
            if obj["kind"] == kind:
                for target in _walk(obj, path.split("."), create):
                    target.update(pairs)


def _add_suffix(objs: list[Obj], suffix: str) -> None:
    renamed: dict[tuple[str, str], str] = {}
    for obj in objs:
        if obj["kind"] not in CLUSTER_SCOPED:
            old = obj["metadata"]["name"]
            obj["metadata"]["name"] = old + suffix
            renamed[(obj["kind"], old)] = old + suffix
    for obj in objs:
        for kind, path, ref in NAME_REFERENCES:
            if obj["kind"] == kind:
                for parent, key in _path_values(obj, path):
                    if (ref, parent[key]) in renamed and (kind != "HorizontalPodAutoscaler"
                                                          or parent.get("kind") == ref):
                        parent[key] = renamed[(ref, parent[key])]


def pod_spec(obj: Obj) -> Obj:
    return obj.get("spec", {}).get("template", {}).get("spec", {})


def pod_containers(obj: Obj) -> list[Obj]:
    spec = pod_spec(obj)
    return list(spec.get("containers", [])) + list(spec.get("initContainers", []))


def render_fallback(directory: Path) -> list[Obj]:
    """Assemble a kustomization without kustomize."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objs: list[Obj] = []
    for res in kust.get("resources", []):
        path = (directory / res).resolve()
        objs.extend(render_fallback(path) if path.is_dir() else _load_all(path))
    for entry in kust.get("patches", []):
        for patch in _load_all(directory / entry["path"]):
            kind, name = patch["kind"], patch["metadata"]["name"]
            idx = next(i for i, o in enumerate(objs)
                       if o["kind"] == kind and o["metadata"]["name"] == name)
            if patch.get("$patch") == "delete":
                objs.pop(idx)
            else:
                _merge(objs[idx], patch)
    if "namespace" in kust:
        for obj in objs:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = kust["namespace"]
    if "nameSuffix" in kust:
        _add_suffix(objs, kust["nameSuffix"])
    for entry in kust.get("labels", []):
        _add_labels(objs, entry["pairs"], bool(entry.get("includeSelectors")))
    for image in kust.get("images", []):
        for obj in objs:
            for c in pod_containers(obj):
                if c["image"].split("@")[0].rsplit(":", 1)[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return objs


def render_kubectl(directory: Path) -> list[Obj]:
    out = subprocess.run(["kubectl", "kustomize", str(directory)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@functools.cache
def rendered(overlay: str) -> tuple[Obj, ...]:
    directory = K8S / "overlays" / overlay
    objs = render_kubectl(directory) if KUBECTL else render_fallback(directory)
    return tuple(objs)


# ------------------------------------------------------------ reading objects


def by_kind(objs: tuple[Obj, ...], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: tuple[Obj, ...], kind: str, name: str | None = None) -> Obj:
    found = [o for o in by_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def decoders(objs: tuple[Obj, ...]) -> list[Obj]:
    """The decoder Deployments (one per model)."""
    found = [o for o in by_kind(objs, "Deployment")
             if o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "decoder"]
    assert found, "no decoder Deployment"
    return found


def container(dep: Obj, name: str = "vaed") -> Obj:
    return next(c for c in pod_containers(dep) if c["name"] == name)


def expand(args: list[str], env: list[Obj]) -> list[str]:
    """The kubelet's $(VAR) expansion of container args from literal env values."""
    values = {e["name"]: e["value"] for e in env if "value" in e}

    def sub(m: re.Match[str]) -> str:
        return values.get(m.group(1), m.group(0))

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a) for a in args]


def container_args(dep: Obj, name: str = "vaed") -> list[str]:
    c = container(dep, name)
    out = expand(c.get("args", []), c.get("env", []))
    assert not any("$(" in a for a in out), f"unexpanded variable in {out}"
    return out


def serve_parser() -> argparse.ArgumentParser:
    from vaed.cli import add_serve_arguments

    # allow_abbrev=False: a misspelt flag must fail, not match a prefix.
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    add_serve_arguments(parser)
    return parser


def serve_args(dep: Obj) -> argparse.Namespace:
    """The container args parsed by the real `vaed serve` parser (catches flag typos
    and flags the server does not have yet)."""
    args = container_args(dep)
    assert args[0] == "serve"
    parser = serve_parser()
    try:
        parsed, unknown = parser.parse_known_args(args[1:])
    except argparse.ArgumentError as exc:
        pytest.fail(f"`vaed serve` rejects the manifest args {args[1:]}: {exc}")
    if unknown:
        pytest.fail(f"`vaed serve` has no flag(s) {unknown} used in {dep['metadata']['name']}")
    return parsed


def flag_value(args: list[str], flag: str) -> str | None:
    """The raw text of ``--flag=value`` / ``--flag value`` in an arg list."""
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def model_label(obj: Obj) -> str | None:
    return obj["metadata"].get("labels", {}).get("vaed.io/model")

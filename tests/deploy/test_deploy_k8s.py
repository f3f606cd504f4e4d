"""Offline checks of k8s/: render every overlay, validate it against the
Kubernetes 1.30 schemas (strict), and assert the operational properties.

Rendering uses `kubectl kustomize` when kubectl is on PATH; otherwise a small
built-in renderer assembles the same objects (resources, strategic-merge
patches with $patch: delete, images, namespace). When kubectl is present the
two renderings are compared, so the fallback stays honest.
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

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
K8S_VERSION = "1.30.0"

Obj = dict[str, Any]


# ------------------------------------------------------------ rendering


CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "StorageClass",
                  "PersistentVolume", "CustomResourceDefinition"}
# Strategic-merge keys of the list fields the manifests patch.
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
    "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name",
}


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


def _pod_containers(obj: Obj) -> list[Obj]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
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
    for image in kust.get("images", []):
        for obj in objs:
            for c in _pod_containers(obj):
                if c["image"].split("@")[0].rsplit(":", 1)[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    if "namespace" in kust:
        for obj in objs:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = kust["namespace"]
    return objs


def render_kubectl(directory: Path) -> list[Obj]:
    out = subprocess.run(["kubectl", "kustomize", str(directory)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


KUBECTL = shutil.which("kubectl")


@functools.cache
def rendered(overlay: str) -> tuple[Obj, ...]:
    directory = K8S / "overlays" / overlay
    objs = render_kubectl(directory) if KUBECTL else render_fallback(directory)
    return tuple(objs)


def by_kind(objs: tuple[Obj, ...], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: tuple[Obj, ...], kind: str, name: str | None = None) -> Obj:
    found = [o for o in by_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(objs: tuple[Obj, ...]) -> Obj:
    return one(objs, "Deployment", "vaed")["spec"]["template"]["spec"]["containers"][0]


def serve_args(objs: tuple[Obj, ...]) -> argparse.Namespace:
    """The container args parsed by the real `vaed serve` parser (catches flag typos)."""
    from vaed.cli import add_serve_arguments

    args = container(objs)["args"]
    assert args[0] == "serve"
    # allow_abbrev=False: a misspelt flag must fail, not match a prefix.
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_serve_arguments(parser)
    return parser.parse_args(args[1:])


# ------------------------------------------------------------ rendering and schema


def test_overlays_exist() -> None:
    assert {"dev", "prod"} <= set(OVERLAYS)


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_fallback_renderer_matches_kubectl(overlay: str) -> None:
    def keyed(objs: list[Obj]) -> dict[tuple[str, str], Obj]:
        return {(o["kind"], o["metadata"]["name"]): o for o in objs}

    directory = K8S / "overlays" / overlay
    assert keyed(render_fallback(directory)) == keyed(render_kubectl(directory))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_schema_valid_strict(overlay: str) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    for obj in rendered(overlay):
        kv.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubernetes-validate") is None, reason="kubernetes-validate CLI not on PATH")
def test_schema_valid_strict_cli(tmp_path: Path) -> None:
    files = []
    for overlay in OVERLAYS:
        f = tmp_path / f"{overlay}.yaml"
        f.write_text(yaml.safe_dump_all(list(rendered(overlay)), sort_keys=False))
        files.append(str(f))
    proc = subprocess.run(
        ["kubernetes-validate", "--strict", "--quiet", "-k", K8S_VERSION, *files],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------ Deployment


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_and_resources(overlay: str) -> None:
    c = container(rendered(overlay))
    res = c["resources"]
    assert int(res["limits"]["nvidia.com/gpu"]) == 1
    assert "cpu" in res["requests"] and "memory" in res["requests"]
    assert "memory" in res["limits"]
    assert serve_args(rendered(overlay)).gpu == 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grpc_probes(overlay: str) -> None:
    objs = rendered(overlay)
    c = container(objs)
    port = serve_args(objs).port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c[probe]
        assert p["grpc"]["port"] == port, probe
        assert p["grpc"].get("service", "") == ""
    s = c["startupProbe"]
    # Weights + Triton compile + warm-up can take minutes: at least 5 min budget.
    assert s["periodSeconds"] * s["failureThreshold"] >= 300
    r = c["readinessProbe"]
    assert r["periodSeconds"] * r.get("failureThreshold", 3) <= 15  # out of rotation quickly


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_restricted_security_context(overlay: str) -> None:
    objs = rendered(overlay)
    pod = one(objs, "Deployment", "vaed")["spec"]["template"]["spec"]
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True
    assert isinstance(psc["runAsUser"], int) and psc["runAsUser"] > 0
    assert psc["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc.get("privileged", False) is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert not sc["capabilities"].get("add")
        assert sc["readOnlyRootFilesystem"] is True
        assert sc.get("runAsNonRoot", psc["runAsNonRoot"]) is True
    # "restricted" Pod Security Standard allows only these volume types.
    allowed = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
               "persistentVolumeClaim", "projected", "secret"}
    for v in pod.get("volumes", []):
        assert set(v) - {"name"} <= allowed, v


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_writable_paths_are_emptydirs(overlay: str) -> None:
    objs = rendered(overlay)
    pod = one(objs, "Deployment", "vaed")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container(objs)["volumeMounts"]}
    for path in ("/cache", "/tmp"):
        assert path in mounts, path
        assert "emptyDir" in volumes[mounts[path]["name"]], path
        assert not mounts[path].get("readOnly")
    # Every cache directory the image points at lies on the /cache emptyDir.
    text = (ROOT / "Dockerfile").read_text()
    env = dict(re.findall(r"\b([A-Z_]+)=(/\S*)", text))
    for var in ("TORCH_HOME", "TRITON_CACHE_DIR", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR", "HOME"):
        assert env[var] == "/cache" or env[var].startswith("/cache/"), var


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_graceful_termination_matches_grace(overlay: str) -> None:
    objs = rendered(overlay)
    pod = one(objs, "Deployment", "vaed")["spec"]["template"]["spec"]
    pre_stop = container(objs)["lifecycle"]["preStop"]
    pause = pre_stop["sleep"]["seconds"]
    assert 1 <= pause <= 15
    grace = serve_args(objs).grace
    # kubelet counts preStop inside terminationGracePeriodSeconds; leave >= 5 s
    # after the drain for the process to exit before SIGKILL.
    assert pod["terminationGracePeriodSeconds"] >= pause + grace + 5


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_topology_spread_selects_own_pods(overlay: str) -> None:
    dep = one(rendered(overlay), "Deployment", "vaed")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    tscs = dep["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert {t["topologyKey"] for t in tscs} >= {"kubernetes.io/hostname"}
    for t in tscs:
        assert t["labelSelector"]["matchLabels"].items() <= labels.items()
        assert t["maxSkew"] >= 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_metrics_port_exposed(overlay: str) -> None:
    objs = rendered(overlay)
    c = container(objs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    args = serve_args(objs)
    assert ports["grpc"] == args.port == 50051
    assert ports["metrics"] == args.metrics_port == 9090
    ann = one(objs, "Deployment", "vaed")["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/port"] == str(args.metrics_port)


def test_prod_model_auth_and_offline() -> None:
    objs = rendered("prod")
    pod = one(objs, "Deployment", "vaed")["spec"]["template"]["spec"]
    c = container(objs)
    args = serve_args(objs)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    # Weights from a read-only PVC mounted at /models.
    assert args.model.startswith("/models/")
    m = mounts["/models"]
    assert m["readOnly"] is True
    pvc = volumes[m["name"]]["persistentVolumeClaim"]
    assert pvc["readOnly"] is True and pvc["claimName"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_HUB_OFFLINE"] == "1"
    # The token file lives on a read-only Secret volume.
    assert args.auth_token_file
    token_dir = str(Path(args.auth_token_file).parent)
    secret_mount = mounts[token_dir]
    assert secret_mount["readOnly"] is True
    secret = volumes[secret_mount["name"]]["secret"]
    assert secret["secretName"] == "vaed-auth"
    assert any(i["path"] == Path(args.auth_token_file).name for i in secret["items"])
    # No Secret object is committed: operators create it.
    assert not by_kind(objs, "Secret")


def test_dev_random_weights_no_auth() -> None:
    objs = rendered("dev")
    args = serve_args(objs)
    assert args.model == "random:wan2.1"
    assert args.auth_token_file is None
    pod = one(objs, "Deployment", "vaed")["spec"]["template"]["spec"]
    kinds = {k for v in pod["volumes"] for k in v if k != "name"}
    assert kinds == {"emptyDir"}
    assert {m["mountPath"] for m in container(objs)["volumeMounts"]} == {"/cache", "/tmp"}
    assert not by_kind(objs, "HorizontalPodAutoscaler")
    assert one(objs, "Deployment", "vaed")["spec"]["replicas"] == 1


# ------------------------------------------------------------ Services, PDB, HPA, NetworkPolicy


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services(overlay: str) -> None:
    objs = rendered(overlay)
    labels = one(objs, "Deployment", "vaed")["spec"]["template"]["metadata"]["labels"]
    headless = one(objs, "Service", "vaed-headless")
    assert headless["spec"]["clusterIP"] == "None"
    cluster = one(objs, "Service", "vaed")
    assert cluster["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert cluster["spec"].get("clusterIP") != "None"
    for svc in (headless, cluster):
        assert svc["spec"]["selector"].items() <= labels.items()
        grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert grpc_port["port"] == 50051
        assert grpc_port["appProtocol"] == "kubernetes.io/h2c"
        assert grpc_port["targetPort"] == "grpc"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pdb(overlay: str) -> None:
    objs = rendered(overlay)
    labels = one(objs, "Deployment", "vaed")["spec"]["template"]["metadata"]["labels"]
    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert "maxUnavailable" in pdb["spec"] or "minAvailable" in pdb["spec"]


def test_prod_hpa_on_queue_depth() -> None:
    from vaed.metrics import QUEUED_CHUNKS_METRIC, ServerMetrics

    objs = rendered("prod")
    hpa = one(objs, "HorizontalPodAutoscaler", "vaed")
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "vaed"}
    assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
    names = [m["pods"]["metric"]["name"] for m in spec["metrics"] if m["type"] == "Pods"]
    assert names == [QUEUED_CHUNKS_METRIC]
    # The metric really is exported by the server.
    assert ServerMetrics().registry.get_sample_value(QUEUED_CHUNKS_METRIC) == 0
    # The HPA owns the replica count; a fixed one would fight it on every apply.
    assert "replicas" not in one(objs, "Deployment", "vaed")["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy(overlay: str) -> None:
    objs = rendered(overlay)
    labels = one(objs, "Deployment", "vaed")["spec"]["template"]["metadata"]["labels"]
    port_names = {p["name"] for p in container(objs)["ports"]}
    np = one(objs, "NetworkPolicy", "vaed")
    spec = np["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert "Ingress" in spec["policyTypes"]
    allowed_ports = set()
    for rule in spec["ingress"]:
        # Every rule names its peers and ports: no allow-all.
        assert rule.get("from"), rule
        assert rule.get("ports"), rule
        for peer in rule["from"]:
            assert peer.get("namespaceSelector") or peer.get("podSelector"), peer
            assert "ipBlock" not in peer
        for p in rule["ports"]:
            assert p["port"] in port_names
            allowed_ports.add(p["port"])
    assert allowed_ports == {"grpc", "metrics"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_namespace_enforces_restricted(overlay: str) -> None:
    objs = rendered(overlay)
    ns = one(objs, "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for obj in objs:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == ns["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_image_is_set(overlay: str) -> None:
    image = container(rendered(overlay))["image"]
    assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest")

"""Offline checks of k8s/: render every overlay, validate it against the
Kubernetes 1.30 schemas (strict, bundled with kubernetes-validate: no
network), and assert the operational properties of every decoder in it.

Model layers, weights, the CPU overlay and the autoscaling rule are checked in
test_deploy_models.py; rendering lives in manifests.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from manifests import (
    K8S,
    K8S_VERSION,
    KUBECTL,
    OVERLAYS,
    ROOT,
    Obj,
    by_kind,
    container,
    decoders,
    flag_value,
    container_args,
    one,
    pod_containers,
    pod_spec,
    render_fallback,
    render_kubectl,
    rendered,
    serve_args,
    serve_parser,
)

yaml = pytest.importorskip("yaml")

GPU_OVERLAYS = [o for o in OVERLAYS if o != "cpu"]
# Overlays that serve real weights from a PVC with auth on (the production shape).
PROD_OVERLAYS = ["prod", "wan21", "wan22", "offline"]

# Connection-management and warmup flags the manifests set on `vaed serve`;
# test_new_serve_flags_exist names any the server does not have.
NEW_SERVE_FLAGS = [
    "--keepalive-time", "--keepalive-timeout", "--min-ping-interval",
    "--max-connection-age", "--max-connection-age-grace", "--warmup-shapes",
]


def decoder_params() -> list[tuple[str, str]]:
    return [(o, d["metadata"]["name"]) for o in OVERLAYS for d in decoders(rendered(o))]


DECODERS = decoder_params()


def decoder(overlay: str, name: str) -> Obj:
    return one(rendered(overlay), "Deployment", name)


# ------------------------------------------------------------ rendering and schema


def test_overlays_exist() -> None:
    assert {"dev", "prod", "wan21", "wan22", "cpu", "offline"} <= set(OVERLAYS)


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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_unique_object_names(overlay: str) -> None:
    keys = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in rendered(overlay)]
    assert len(keys) == len(set(keys))


# ------------------------------------------------------------ server flags


def test_new_serve_flags_exist() -> None:
    """Fails until `vaed serve` has every flag the manifests rely on."""
    known = {s for a in serve_parser()._actions for s in a.option_strings}
    missing = [f for f in NEW_SERVE_FLAGS if f not in known]
    assert not missing, f"`vaed serve` lacks {missing}, which k8s/ uses"


@pytest.mark.parametrize("overlay,name", DECODERS)
def test_manifest_flags_parse(overlay: str, name: str) -> None:
    args = container_args(decoder(overlay, name))
    used = {a.split("=", 1)[0] for a in args[1:] if a.startswith("--")}
    assert set(NEW_SERVE_FLAGS) <= used, f"{name} does not set {set(NEW_SERVE_FLAGS) - used}"
    serve_args(decoder(overlay, name))  # every flag exists and every value parses


@pytest.mark.parametrize("overlay,name", DECODERS)
def test_connection_lifecycle(overlay: str, name: str) -> None:
    """Clients reach replicas added later: connections age out within minutes,
    in-flight calls get a grace longer than a Decode, and keepalive settings
    agree with the client library's."""
    from vaed_client.channel import KEEPALIVE_TIME_MS

    args = container_args(decoder(overlay, name))
    value = {f: float(flag_value(args, f) or "nan") for f in NEW_SERVE_FLAGS if f != "--warmup-shapes"}
    # Re-resolution within 1-10 min: new pods get traffic soon, without
    # reconnect storms (gRPC adds +-10 % jitter to the age).
    assert 60 <= value["--max-connection-age"] <= 600
    # A 720x1280x81 Decode takes ~3 s on an H200; calls in flight when the
    # connection ages out must finish, so allow at least a minute.
    assert value["--max-connection-age-grace"] >= 60
    # The client pings every 60 s; the server must permit that or it answers
    # GOAWAY too_many_pings and every long call fails.
    assert value["--min-ping-interval"] <= KEEPALIVE_TIME_MS / 1000
    assert 0 < value["--keepalive-timeout"] < value["--keepalive-time"]


# ------------------------------------------------------------ Deployment


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_and_resources(overlay: str) -> None:
    for dep in decoders(rendered(overlay)):
        res = container(dep)["resources"]
        assert int(res["limits"]["nvidia.com/gpu"]) == 1
        assert "cpu" in res["requests"] and "memory" in res["requests"]
        assert "memory" in res["limits"]
        # --gpu is a device list ("0", "0,1", "all"); one GPU per pod here.
        assert str(serve_args(dep).gpu) == "0"


@pytest.mark.parametrize("overlay,name", DECODERS)
def test_grpc_probes(overlay: str, name: str) -> None:
    dep = decoder(overlay, name)
    c = container(dep)
    port = serve_args(dep).port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c[probe]
        assert p["grpc"]["port"] == port, probe
        assert p["grpc"].get("service", "") == ""
    s = c["startupProbe"]
    # Weights + Triton compile + warm-up can take minutes: at least 5 min budget,
    # plus a minute per warm-up shape (each reaches its steady chunk, ~6 s on an
    # H200; the margin covers slower GPUs and cold volumes).
    shapes = flag_value(container_args(dep), "--warmup-shapes") or ""
    n_shapes = 0 if shapes in ("", "none") else len(shapes.split(","))
    assert s["periodSeconds"] * s["failureThreshold"] >= 300 + 60 * n_shapes
    r = c["readinessProbe"]
    assert r["periodSeconds"] * r.get("failureThreshold", 3) <= 15  # out of rotation quickly


def _check_restricted_pod(pod: Obj) -> None:
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True
    assert isinstance(psc["runAsUser"], int) and psc["runAsUser"] > 0
    assert psc["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    for c in list(pod["containers"]) + list(pod.get("initContainers") or []):
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
def test_restricted_security_context(overlay: str) -> None:
    objs = rendered(overlay)
    workloads = by_kind(objs, "Deployment") + by_kind(objs, "Job")
    assert workloads
    for obj in workloads:
        _check_restricted_pod(pod_spec(obj))


@pytest.mark.parametrize("overlay,name", DECODERS)
def test_writable_paths_are_emptydirs(overlay: str, name: str) -> None:
    dep = decoder(overlay, name)
    volumes = {v["name"]: v for v in pod_spec(dep)["volumes"]}
    mounts = {m["mountPath"]: m for m in container(dep)["volumeMounts"]}
    for path in ("/cache", "/tmp"):
        assert path in mounts, path
        assert "emptyDir" in volumes[mounts[path]["name"]], path
        assert not mounts[path].get("readOnly")
    # Every cache directory the image points at lies on the /cache emptyDir.
    text = (ROOT / "Dockerfile").read_text()
    env = dict(re.findall(r"\b([A-Z_]+)=(/\S*)", text))
    for var in ("TORCH_HOME", "TRITON_CACHE_DIR", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR", "HOME"):
        assert env[var] == "/cache" or env[var].startswith("/cache/"), var


def _triton_cache_dir(dep: Obj) -> str:
    """Where the decoder's Triton keeps compiled kernels: --kernel-cache, else the container's
    TRITON_CACHE_DIR, else the image's (the Dockerfile's ENV)."""
    flag = serve_args(dep).kernel_cache
    env = {e["name"]: e.get("value") for e in container(dep).get("env", [])}
    image = dict(re.findall(r"\b([A-Z_]+)=(/\S*)", (ROOT / "Dockerfile").read_text()))
    return flag or env.get("TRITON_CACHE_DIR") or image["TRITON_CACHE_DIR"]


def _volume_at(dep: Obj, path: str) -> tuple[Obj, Obj]:
    """(mount, volume) of the container's mount that holds `path`."""
    mounts = [m for m in container(dep)["volumeMounts"]
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{path} is on no volume (the root filesystem is read-only)"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volumes = {v["name"]: v for v in pod_spec(dep)["volumes"]}
    return mount, volumes[mount["name"]]


@pytest.mark.parametrize("overlay", PROD_OVERLAYS)
def test_triton_kernels_are_kept_on_a_volume_that_outlives_the_pod(overlay: str) -> None:
    """A new pod of a model (restart, rollout, scale-up) finds the kernels the earlier ones
    compiled: Triton's cache directory is on a writable ReadWriteMany PVC of this build, one per
    model, not on the /cache emptyDir."""
    objs = rendered(overlay)
    claims = {c["metadata"]["name"]: c for c in by_kind(objs, "PersistentVolumeClaim")}
    used = []
    for dep in decoders(objs):
        cache = _triton_cache_dir(dep)
        mount, volume = _volume_at(dep, cache)
        assert not mount.get("readOnly"), mount
        pvc = volume["persistentVolumeClaim"]
        assert not pvc.get("readOnly")
        claim = claims[pvc["claimName"]]  # part of the build, renamed with its model
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
        assert claim["metadata"]["labels"]["app.kubernetes.io/component"] == "kernel-cache"
        used.append(pvc["claimName"])
    assert len(used) == len(set(used)) == len(decoders(objs))  # one cache per model


@pytest.mark.parametrize("overlay", ["dev", "cpu"])
def test_single_pod_overlays_keep_kernels_on_the_cache_emptydir(overlay: str) -> None:
    """dev (one GPU pod, restarted in place) and cpu (no Triton) need no RWX storage: Triton's
    cache stays on the /cache emptyDir, which a container restart keeps."""
    objs = rendered(overlay)
    (dep,) = decoders(objs)
    mount, volume = _volume_at(dep, _triton_cache_dir(dep))
    assert mount["mountPath"] == "/cache" and "emptyDir" in volume
    assert not [c for c in by_kind(objs, "PersistentVolumeClaim")
                if c["metadata"]["labels"].get("app.kubernetes.io/component") == "kernel-cache"]


@pytest.mark.parametrize("overlay,name", DECODERS)
def test_graceful_termination_matches_grace(overlay: str, name: str) -> None:
    dep = decoder(overlay, name)
    pre_stop = container(dep)["lifecycle"]["preStop"]
    pause = pre_stop["sleep"]["seconds"]
    assert 1 <= pause <= 15
    grace = serve_args(dep).grace
    # kubelet counts preStop inside terminationGracePeriodSeconds; leave >= 5 s
    # after the drain for the process to exit before SIGKILL.
    assert pod_spec(dep)["terminationGracePeriodSeconds"] >= pause + grace + 5


@pytest.mark.parametrize("overlay,name", DECODERS)
def test_topology_spread_selects_own_pods(overlay: str, name: str) -> None:
    dep = decoder(overlay, name)
    labels = dep["spec"]["template"]["metadata"]["labels"]
    tscs = pod_spec(dep)["topologySpreadConstraints"]
    assert {t["topologyKey"] for t in tscs} >= {"kubernetes.io/hostname"}
    for t in tscs:
        assert t["labelSelector"]["matchLabels"].items() <= labels.items()
        assert t["maxSkew"] >= 1


@pytest.mark.parametrize("overlay,name", DECODERS)
def test_metrics_port_exposed(overlay: str, name: str) -> None:
    dep = decoder(overlay, name)
    c = container(dep)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    args = serve_args(dep)
    assert ports["grpc"] == args.port == 50051
    assert ports["metrics"] == args.metrics_port == 9090
    assert ports["http"] == args.http_port == 8000  # the HTTP front: remote_decode, curl, /health
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/port"] == str(args.metrics_port)


@pytest.mark.parametrize("overlay", PROD_OVERLAYS)
def test_prod_model_auth_and_offline(overlay: str) -> None:
    objs = rendered(overlay)
    for dep in decoders(objs):
        pod = pod_spec(dep)
        c = container(dep)
        args = serve_args(dep)
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
    (dep,) = decoders(objs)
    args = serve_args(dep)
    assert args.model == "random:wan2.1"
    assert args.auth_token_file is None
    pod = pod_spec(dep)
    kinds = {k for v in pod["volumes"] for k in v if k != "name"}
    assert kinds == {"emptyDir"}
    assert {m["mountPath"] for m in container(dep)["volumeMounts"]} == {"/cache", "/tmp"}
    assert not pod.get("initContainers")
    assert not by_kind(objs, "HorizontalPodAutoscaler")
    assert not by_kind(objs, "Job") and not by_kind(objs, "PersistentVolumeClaim")
    assert dep["spec"]["replicas"] == 1


# ------------------------------------------------------------ Services, PDB, NetworkPolicy


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services(overlay: str) -> None:
    objs = rendered(overlay)
    services = by_kind(objs, "Service")
    for dep in decoders(objs):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        mine = [s for s in services if s["spec"]["selector"].items() <= labels.items()]
        headless = [s for s in mine if s["spec"].get("clusterIP") == "None"]
        cluster = [s for s in mine if s["spec"].get("clusterIP") != "None"]
        assert len(headless) == 1 and len(cluster) == 1, dep["metadata"]["name"]
        assert headless[0]["metadata"]["name"].startswith("vaed-headless")
        assert cluster[0]["spec"].get("type", "ClusterIP") == "ClusterIP"
        for svc in headless + cluster:
            grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
            assert grpc_port["port"] == 50051
            assert grpc_port["appProtocol"] == "kubernetes.io/h2c"
            assert grpc_port["targetPort"] == "grpc"
        # the HTTP front on the ClusterIP Service (it closes each connection after its answer,
        # so kube-proxy balances requests); the container's named port is its target
        (http_port,) = [p for p in cluster[0]["spec"]["ports"] if p["name"] == "http"]
        assert http_port["port"] == serve_args(dep).http_port and http_port["targetPort"] == "http"
        assert {p["name"] for p in container(dep)["ports"]} >= {"http"}
    assert len(services) == 2 * len(decoders(objs))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pdb(overlay: str) -> None:
    objs = rendered(overlay)
    pdbs = by_kind(objs, "PodDisruptionBudget")
    for dep in decoders(objs):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        (pdb,) = [p for p in pdbs if p["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert "maxUnavailable" in pdb["spec"] or "minAvailable" in pdb["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy(overlay: str) -> None:
    objs = rendered(overlay)
    np = one(objs, "NetworkPolicy", "vaed")
    spec = np["spec"]
    assert "Ingress" in spec["policyTypes"]
    for dep in decoders(objs):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert spec["podSelector"]["matchLabels"].items() <= labels.items()
        port_names = {p["name"] for p in container(dep)["ports"]}
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
        assert allowed_ports == {"grpc", "metrics", "http"}
        # the HTTP front is open to exactly the gRPC port's peers (the generation workers)
        peers_of = {p["port"]: rule["from"] for rule in spec["ingress"] for p in rule["ports"]}
        assert peers_of["http"] == peers_of["grpc"]
    # Peers are selected by their own labels only: a model label leaking in
    # from the model layers would match no kube-dns, client or Prometheus pod.
    peers = [peer for rule in spec["ingress"] for peer in rule["from"]]
    peers += [peer for rule in spec.get("egress", []) for peer in rule["to"]]
    for peer in peers:
        assert "vaed.io/model" not in peer.get("podSelector", {}).get("matchLabels", {}), peer
    dns = [p for p in peers if p.get("podSelector", {}).get("matchLabels") == {"k8s-app": "kube-dns"}]
    assert dns, "egress to kube-dns must stay allowed"


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
    objs = rendered(overlay)
    images = {c["image"] for o in by_kind(objs, "Deployment") for c in pod_containers(o)}
    assert len(images) == 1, images  # decoders and their init containers run one image
    job_images = {c["image"] for o in by_kind(objs, "Job") for c in pod_containers(o)}
    if overlay != "offline":  # offline copies from weights images
        assert job_images <= images, job_images
    for image in images | job_images:
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest")


def test_cpu_overlay_runs_the_cpu_image_the_docs_build() -> None:
    """The cpu overlay's image is the one `docker build --target cpu` makes in the docs and in
    the overlay's own comment, and the Dockerfile has that target."""
    (image,) = {c["image"] for o in by_kind(rendered("cpu"), "Deployment") for c in pod_containers(o)}
    build = f"docker build --target cpu -t {image} ."
    docs = (ROOT / "docs" / "deployment.md").read_text()
    assert f"{build} && kind load docker-image {image}" in docs
    assert build in (ROOT / "k8s" / "overlays" / "cpu" / "kustomization.yaml").read_text()
    assert re.search(r"^FROM \S+ AS cpu$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)


def test_docs_set_images_without_the_standalone_kustomize() -> None:
    """kubectl has no `kustomize edit`: the docs show the images: stanza to edit, and it is
    the stanza every overlay carries."""
    import yaml

    docs = (ROOT / "docs" / "deployment.md").read_text()
    commands = "".join(re.findall(r"```bash\n(.*?)```", docs, re.DOTALL))
    assert "kustomize edit" not in commands, "a command needs the standalone kustomize binary"
    stanza = re.search(r"```yaml\n(# k8s/overlays/prod/kustomization.yaml.*?)```", docs, re.DOTALL)
    assert stanza, "no images: stanza in docs/deployment.md"
    shown = yaml.safe_load(stanza.group(1))["images"]
    for overlay in OVERLAYS:
        kustomization = yaml.safe_load((ROOT / "k8s" / "overlays" / overlay / "kustomization.yaml").read_text())
        assert [i["name"] for i in kustomization["images"]] == [i["name"] for i in shown], overlay
        assert set(kustomization["images"][0]) == set(shown[0]), overlay

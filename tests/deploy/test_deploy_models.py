"""Offline checks of what makes k8s/ operable per model: one decoder per model
with consistent weights paths, the weights Job and the init container that
waits for it, the CPU overlay, the HPA on vaed_pending_latent_frames with its
derived targets, the prometheus-adapter rule, and the docs naming them."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from types import ModuleType

import pytest
from harness import load_script
from manifests import (
    K8S,
    K8S_VERSION,
    OVERLAYS,
    ROOT,
    Obj,
    by_kind,
    container,
    container_args,
    decoders,
    flag_value,
    model_label,
    one,
    pod_spec,
    rendered,
    serve_args,
)

yaml = pytest.importorskip("yaml")

PENDING_METRIC = "vaed_pending_latent_frames"
# Per model: hub repository, folder under /models, z_dim, warm-up shapes, and
# the measured steady decode rate (latent frames/s, H200 bf16) of its main
# shape that the HPA target derives from (docs/deployment.md, "Autoscaling").
MODELS = {
    "wan2.1": dict(repo="Wan-AI/Wan2.1-T2V-1.3B-Diffusers", z_dim=16, shapes="480x832,720x1280", rate=1 / 0.062),
    "wan2.2": dict(repo="Wan-AI/Wan2.2-TI2V-5B-Diffusers", z_dim=48, shapes="704x1280", rate=1 / 0.150),
}
WEIGHT_OVERLAYS = {"prod": {"wan2.1", "wan2.2"}, "wan21": {"wan2.1"}, "wan22": {"wan2.2"},
                   "offline": {"wan2.1", "wan2.2"}}
FETCH_SCRIPT = "/opt/vaed/fetch_weights.py"


@pytest.fixture(scope="module")
def fetch_weights() -> ModuleType:
    return load_script("scripts/fetch_weights.py", "fetch_weights_for_k8s")


def fetch_args(fw: ModuleType, c_args: list[str]) -> argparse.Namespace:
    return fw.build_parser().parse_args(c_args)


def claim(pod: Obj, mount_path: str, c: Obj) -> str:
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == mount_path)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    return volume["persistentVolumeClaim"]["claimName"]


# ------------------------------------------------------------ one decoder per model


@pytest.mark.parametrize("overlay,models", sorted(WEIGHT_OVERLAYS.items()))
def test_one_decoder_per_model(overlay: str, models: set[str]) -> None:
    objs = rendered(overlay)
    deps = decoders(objs)
    assert {model_label(d) for d in deps} == models
    for dep in deps:
        assert dep["spec"]["template"]["metadata"]["labels"]["vaed.io/model"] == model_label(dep)
        assert dep["spec"]["selector"]["matchLabels"]["vaed.io/model"] == model_label(dep)
    # Every Service, PDB and HPA belongs to exactly one model's pods: a Wan2.1
    # client must never be balanced onto a Wan2.2 pod (z_dim 16 vs 48).
    for obj in by_kind(objs, "Service") + by_kind(objs, "PodDisruptionBudget"):
        sel = obj["spec"]["selector"]
        sel = sel.get("matchLabels", sel)
        owners = [d for d in deps if sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(owners) == 1, obj["metadata"]["name"]
        assert model_label(obj) == model_label(owners[0])
    for hpa in by_kind(objs, "HorizontalPodAutoscaler"):
        target = one(objs, "Deployment", hpa["spec"]["scaleTargetRef"]["name"])
        assert model_label(hpa) == model_label(target)


def test_offline_differs_from_prod_only_in_weights_jobs() -> None:
    def keyed(objs: tuple[Obj, ...]) -> dict[tuple[str, str], Obj]:
        return {(o["kind"], o["metadata"]["name"]): o for o in objs}

    prod, offline = keyed(rendered("prod")), keyed(rendered("offline"))
    assert prod.keys() == offline.keys()
    differ = {k for k in prod if prod[k] != offline[k]}
    assert differ == {k for k in prod if k[0] == "Job"}
    for job in by_kind(rendered("offline"), "Job"):
        args = container_args(job, "fetch")
        assert not any(a.startswith("--repo") for a in args) and flag_value(args, "--from-dir")


def test_prod_is_both_single_model_overlays() -> None:
    """prod = wan21 + wan22 applied together: the same objects, so the docs'
    single-model and two-model instructions never drift apart."""
    def keyed(objs: tuple[Obj, ...]) -> dict[tuple[str, str], Obj]:
        return {(o["kind"], o["metadata"]["name"]): o for o in objs}

    union = {**keyed(rendered("wan21")), **keyed(rendered("wan22"))}
    shared = keyed(rendered("wan21")).keys() & keyed(rendered("wan22")).keys()
    assert shared == {("Namespace", "vaed"), ("NetworkPolicy", "vaed")}
    for key in shared:  # applying both overlays must not flip a shared object
        assert keyed(rendered("wan21"))[key] == keyed(rendered("wan22"))[key]
    assert keyed(rendered("prod")) == union


@pytest.mark.parametrize("overlay", sorted(WEIGHT_OVERLAYS))
def test_model_paths_consistent(overlay: str, fetch_weights: ModuleType) -> None:
    """--model, the init container's --dest, the Job's --dest and its repo all
    name one folder on one PVC, with the z_dim of that model."""
    objs = rendered(overlay)
    jobs = by_kind(objs, "Job")
    for dep in decoders(objs):
        spec = MODELS[model_label(dep)]
        model_dir = "/models/" + spec["repo"].split("/")[1]
        assert serve_args(dep).model == model_dir
        assert flag_value(container_args(dep), "--warmup-shapes") == spec["shapes"]
        pod = pod_spec(dep)
        pvc = claim(pod, "/models", container(dep))

        init = container(dep, "wait-weights")
        assert init["command"] == ["python", FETCH_SCRIPT]
        wait = fetch_args(fetch_weights, container_args(dep, "wait-weights"))
        assert wait.check and wait.wait >= 600
        assert str(wait.dest) == model_dir and wait.expect_z_dim == spec["z_dim"]
        assert claim(pod, "/models", init) == pvc
        assert all(m.get("readOnly") for m in init["volumeMounts"] if m["mountPath"] == "/models")

        (job,) = [j for j in jobs if model_label(j) == model_label(dep)]
        fetch = fetch_args(fetch_weights, container_args(job, "fetch"))
        if fetch.from_dir is not None:  # offline: copied from a weights image, same folder name
            assert fetch.from_dir.name == Path(model_dir).name
        else:
            assert fetch.repo == spec["repo"]
        assert str(fetch.dest) == model_dir
        assert fetch.expect_z_dim == spec["z_dim"]
        assert claim(pod_spec(job), "/models", container(job, "fetch")) == pvc
        one(objs, "PersistentVolumeClaim", pvc)


def test_dockerfile_default_model_is_the_wan21_layer() -> None:
    text = (ROOT / "Dockerfile").read_text()
    # the last CMD: the default target's (the GPU image; the cpu target serves the tiny model)
    cmd = json.loads(re.findall(r"^CMD (\[.*?\])", text, re.S | re.M)[-1].replace("\\\n", ""))
    (dep,) = decoders(rendered("wan21"))
    assert cmd[cmd.index("--model") + 1] == serve_args(dep).model


@pytest.mark.parametrize("overlay", sorted(WEIGHT_OVERLAYS))
def test_weights_job_and_pvc(overlay: str) -> None:
    objs = rendered(overlay)
    for job in by_kind(objs, "Job"):
        pod = pod_spec(job)
        c = container(job, "fetch")
        assert pod["restartPolicy"] in ("Never", "OnFailure")
        assert job["spec"]["backoffLimit"] >= 1 and job["spec"]["activeDeadlineSeconds"] > 0
        # Deleted after it finishes, so the next apply re-creates it (a no-op on a
        # complete folder) instead of failing on the immutable pod template.
        assert job["spec"]["ttlSecondsAfterFinished"] > 0
        # Writes the PVC, needs no GPU, and keeps hub caches on an emptyDir.
        models = next(m for m in c["volumeMounts"] if m["mountPath"] == "/models")
        assert not models.get("readOnly")
        assert not any("nvidia.com/gpu" in r for r in c["resources"].values())
        assert "tolerations" not in pod
        assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/cache", "/tmp"}
        env = {e["name"]: e for e in c["env"]}
        assert "HF_HUB_OFFLINE" not in env
        # The weights image of the offline overlay is built FROM the vaed image:
        # the same script at the same path.
        assert c["command"] == ["python", FETCH_SCRIPT]
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
        # The xet chunk cache (10 GB by default) would overflow the /cache emptyDir.
        assert env["HF_XET_CHUNK_CACHE_SIZE_BYTES"]["value"] == "0"
        # The decoders' NetworkPolicy (DNS-only egress) must not select the Job.
        np = one(objs, "NetworkPolicy", "vaed")["spec"]["podSelector"]["matchLabels"]
        assert not np.items() <= job["spec"]["template"]["metadata"]["labels"].items()
    claims = by_kind(objs, "PersistentVolumeClaim")
    # the weights' and Triton's kernel cache (test_deploy_k8s checks the latter); no other
    components = [c["metadata"]["labels"]["app.kubernetes.io/component"] for c in claims]
    assert set(components) <= {"weights", "kernel-cache"} and "weights" in components
    for pvc in (c for c, component in zip(claims, components, strict=True) if component == "weights"):
        # Written once by the Job, read by decoder pods on any node.
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
        size = pvc["spec"]["resources"]["requests"]["storage"]
        assert re.fullmatch(r"\d+Gi", size)
        # vae/ is ~0.51 GB (Wan2.1) / ~2.82 GB (Wan2.2): at least 2x headroom.
        need = {"wan2.1": 0.51, "wan2.2": 2.82}[model_label(pvc)]
        assert int(size[:-2]) * 2**30 / 1e9 >= 2 * need


def test_dockerfile_ships_fetch_script() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^COPY scripts/fetch_weights\.py " + re.escape(FETCH_SCRIPT) + r"$", text, re.M)


# ------------------------------------------------------------ CPU overlay


def test_cpu_overlay_needs_no_gpu_no_weights() -> None:
    objs = rendered("cpu")
    (dep,) = decoders(objs)
    args = serve_args(dep)
    assert args.device == "cpu" and args.gpu is None
    assert args.model == "random:wan2.1-tiny"
    assert args.auth_token_file is None
    text = json.dumps(list(objs))
    assert "nvidia.com/gpu" not in text  # no GPU request, limit or toleration
    assert not by_kind(objs, "PersistentVolumeClaim") and not by_kind(objs, "Job")
    assert not by_kind(objs, "HorizontalPodAutoscaler")
    pod = pod_spec(dep)
    assert not pod.get("initContainers")
    assert {k for v in pod["volumes"] for k in v if k != "name"} == {"emptyDir"}
    assert dep["spec"]["replicas"] == 1


def test_cpu_model_spec_exists() -> None:
    from vaed.models import RANDOM_CONFIGS

    (dep,) = decoders(rendered("cpu"))
    assert serve_args(dep).model.removeprefix("random:") in RANDOM_CONFIGS


# ------------------------------------------------------------ autoscaling


@pytest.mark.parametrize("overlay", sorted(WEIGHT_OVERLAYS))
def test_hpa_on_pending_latent_frames(overlay: str) -> None:
    objs = rendered(overlay)
    hpas = by_kind(objs, "HorizontalPodAutoscaler")
    assert len(hpas) == len(decoders(objs))
    for hpa in hpas:
        spec = hpa["spec"]
        ref = spec["scaleTargetRef"]
        assert ref["apiVersion"] == "apps/v1" and ref["kind"] == "Deployment"
        target = one(objs, "Deployment", ref["name"])
        assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
        (metric,) = [m for m in spec["metrics"] if m["type"] == "Pods"]
        assert metric["pods"]["metric"]["name"] == PENDING_METRIC
        assert metric["pods"]["target"]["type"] == "AverageValue"
        # The target is 1-2.5 s of queued work at the model's main shape.
        pending = float(metric["pods"]["target"]["averageValue"])
        seconds = pending / MODELS[model_label(target)]["rate"]
        assert 0.5 <= seconds <= 2.5, (hpa["metadata"]["name"], seconds)
        # The HPA owns the replica count; a fixed one would fight it on every apply.
        assert "replicas" not in target["spec"]
        # New pods cost minutes: scale down slower than up.
        b = spec["behavior"]
        assert b["scaleDown"]["stabilizationWindowSeconds"] > b["scaleUp"]["stabilizationWindowSeconds"]


def test_server_exports_pending_latent_frames() -> None:
    """Fails until the server exports the HPA's metric under this name."""
    import vaed.metrics as metrics
    from prometheus_client import generate_latest

    text = generate_latest(metrics.ServerMetrics().registry).decode()
    assert re.search(rf"^# TYPE {PENDING_METRIC} gauge$", text, re.M), f"{PENDING_METRIC} is not exported"


def adapter_rules() -> tuple[Obj, list[Obj]]:
    cm = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-rules.yaml").read_text())
    return cm, yaml.safe_load(cm["data"]["config.yaml"])["rules"]


def test_adapter_rule_serves_the_hpa_metric() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    cm, rules = adapter_rules()
    kv.validate(cm, K8S_VERSION, strict=True)
    names = {r["name"]["as"] for r in rules}
    for overlay in OVERLAYS:
        for hpa in by_kind(rendered(overlay), "HorizontalPodAutoscaler"):
            for m in hpa["spec"]["metrics"]:
                assert m["pods"]["metric"]["name"] in names
    (rule,) = [r for r in rules if r["name"]["as"] == PENDING_METRIC]
    assert rule["seriesQuery"].startswith(PENDING_METRIC + "{")
    assert re.fullmatch(rule["name"]["matches"], PENDING_METRIC)
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
    # Per pod (summed over its GPUs), matched to the HPA's pods.
    assert "<<.GroupBy>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]


# ------------------------------------------------------------ docs


def test_docs_name_what_ships() -> None:
    doc = (ROOT / "docs" / "deployment.md").read_text()
    for overlay in OVERLAYS:
        assert f"k8s/overlays/{overlay}" in doc, overlay
    for word in (PENDING_METRIC, "scripts/fetch_weights.py", "k8s/monitoring/prometheus-adapter-rules.yaml",
                 "--max-connection-age", "--warmup-shapes", "vaed-auth", "VAED_AUTH_TOKEN"):
        assert word in doc, word
    assert "vaed_queued_chunks" not in doc
    for spec in MODELS.values():
        assert spec["repo"] in doc


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_cpu_overlay_args_really_serve(tmp_path: Path) -> None:
    """`vaed serve` with the cpu overlay's exact args (ports and bind address
    swapped for local ones) reports SERVING, decodes, exports the HPA metric,
    and exits 0 on SIGTERM: what a kind cluster would run."""
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    import grpc
    import numpy as np
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from vaed_client import VaeClient

    (dep,) = decoders(rendered("cpu"))
    port, metrics_port = _free_port(), _free_port()
    swap = {"--port": str(port), "--metrics-port": str(metrics_port), "--host": "127.0.0.1"}
    args = [f"{a.split('=')[0]}={swap[a.split('=')[0]]}" if a.split("=")[0] in swap else a
            for a in container_args(dep)]
    log = tmp_path / "serve.log"
    out = log.open("w")  # a file, not a pipe: a full pipe would block the server
    proc = subprocess.Popen([sys.executable, "-c", "from vaed.cli import main; raise SystemExit(main())", *args],
                            stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 180  # a guard against hanging, not a speed check
            status = None
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                except grpc.RpcError:
                    status = None
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                time.sleep(0.5)
            assert status == health_pb2.HealthCheckResponse.SERVING, log.read_text()
        z_dim = 4  # random:wan2.1-tiny
        latents = np.random.default_rng(0).standard_normal((1, z_dim, 2, 4, 6)).astype(np.float32)
        with VaeClient(f"127.0.0.1:{port}", timeout=60) as vae:
            video = vae.decode(latents)
        assert video.shape == (1, 5, 32, 48, 3) and video.dtype == np.uint8
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert f"# TYPE {PENDING_METRIC} gauge" in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=pod_spec(dep)["terminationGracePeriodSeconds"]) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()

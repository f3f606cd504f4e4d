"""Mutual TLS: `vaed serve --tls-client-ca` admits only clients whose certificate that CA signed.

The CA, server and client certificates are made here at test time (the `cryptography`
package); a real `vaed serve` process runs with --tls-cert/--tls-key/--tls-client-ca and the
real client presents its certificate through `tls_client_cert`/`tls_client_key` (and the
`vaed health` command through --tls-client-cert/--tls-client-key).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from vaed_client import VaeClient
from vaed_client import cli as client_cli
from vaed_client.errors import UnavailableError

import harness


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, harness.Pki]:
    directory = tmp_path_factory.mktemp("pki")
    # "rogue": a second CA with a client certificate of its own, which the server must not trust
    return {"trusted": harness.write_pki(directory, "trusted"), "rogue": harness.write_pki(directory, "rogue")}


@pytest.fixture(scope="module")
def mtls_server(pki: dict[str, harness.Pki]) -> Iterator[str]:
    ca = pki["trusted"]
    proc, target = harness.start_cli_server(
        "--no-warmup", "--tls-cert", str(ca.server_cert), "--tls-key", str(ca.server_key),
        "--tls-client-ca", str(ca.ca),
    )
    try:
        yield target
    finally:
        proc.terminate()
        proc.wait(60)


def _latents(t: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((1, 4, t, 5, 7), dtype=np.float32)


def test_a_client_with_a_certificate_the_ca_signed_decodes(mtls_server: str, pki: dict[str, harness.Pki]) -> None:
    ca = pki["trusted"]
    with VaeClient(mtls_server, timeout=120, tls=str(ca.ca),
                   tls_client_cert=str(ca.client_cert), tls_client_key=str(ca.client_key)) as client:
        assert client.model_info().z_dim == 4
        video = client.decode(_latents(2))
    assert video.dtype == np.uint8 and video.shape == (1, 5, 40, 56, 3)  # 1 + 4 frames of 8x upscaled 5x7


def test_a_client_without_a_certificate_is_refused(mtls_server: str, pki: dict[str, harness.Pki]) -> None:
    # it verifies the server (the trusted CA) but has nothing to show: the handshake fails
    with VaeClient(mtls_server, timeout=10, tls=str(pki["trusted"].ca)) as client:
        with pytest.raises(UnavailableError):
            client.model_info()


def test_a_client_with_another_cas_certificate_is_refused(mtls_server: str, pki: dict[str, harness.Pki]) -> None:
    rogue = pki["rogue"]
    with VaeClient(mtls_server, timeout=10, tls=str(pki["trusted"].ca),
                   tls_client_cert=str(rogue.client_cert), tls_client_key=str(rogue.client_key)) as client:
        with pytest.raises(UnavailableError):
            client.model_info()


def _health(target: str, *flags: str) -> tuple[bool, str]:
    parser = argparse.ArgumentParser()
    client_cli.add_health_arguments(parser)
    return client_cli.check_health(parser.parse_args(["--server", target, "--timeout", "10", *flags]))


def test_vaed_health_presents_its_certificate(mtls_server: str, pki: dict[str, harness.Pki]) -> None:
    """Health needs no token but, like every call, a certificate the CA signed."""
    ca = pki["trusted"]
    assert _health(mtls_server, "--ca-cert", str(ca.ca), "--tls-client-cert", str(ca.client_cert),
                   "--tls-client-key", str(ca.client_key)) == (True, "SERVING")
    serving, text = _health(mtls_server, "--ca-cert", str(ca.ca))
    assert not serving and "UNAVAILABLE" in text
    serving, text = _health(mtls_server, "--ca-cert", str(ca.ca), "--tls-client-cert", str(ca.client_cert))
    assert not serving and "both --tls-client-cert and --tls-client-key" in text


@pytest.mark.parametrize("flag", ["--tls-client-ca", "--tls-cert"])
def test_half_a_tls_configuration_fails_startup_saying_so(flag: str, pki: dict[str, harness.Pki]) -> None:
    """A client CA without the server's own certificate, or a certificate without its key: exit 2
    with the reason (it was once reported as an address that could not be bound)."""
    path = pki["trusted"].ca if flag == "--tls-client-ca" else pki["trusted"].server_cert
    proc = subprocess.run(
        [sys.executable, "-m", "vaed.cli", "serve", "--device", "cpu", "--host", "127.0.0.1", "--port", "0",
         "--model", "random:wan2.1-tiny", "--no-warmup", flag, str(path)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "TLS needs both --tls-cert and --tls-key" in proc.stderr and "could not bind" not in proc.stderr


def test_the_client_refuses_half_a_client_identity(pki: dict[str, harness.Pki]) -> None:
    ca = pki["trusted"]
    with pytest.raises(ValueError, match="both tls_client_cert and tls_client_key"):
        VaeClient("127.0.0.1:1", tls=str(ca.ca), tls_client_cert=str(ca.client_cert))
    with pytest.raises(ValueError, match="needs a TLS channel"):
        VaeClient("127.0.0.1:1", tls_client_cert=str(ca.client_cert), tls_client_key=str(ca.client_key))


@pytest.mark.parametrize("case", ["cert not PEM", "key of another", "ca not PEM"])
def test_tls_files_that_are_no_pem_pair_fail_startup_naming_them(case: str, pki: dict[str, harness.Pki],
                                                                   tmp_path) -> None:
    """Exit 2 naming the files (gRPC refused them only as it bound: "could not bind ... check
    --host and --port")."""
    ours, rogue = pki["trusted"], pki["rogue"]
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    flags, message = {
        "cert not PEM": (["--tls-cert", str(junk), "--tls-key", str(ours.server_key)],
                         "are not a PEM certificate and its unencrypted private key"),
        "key of another": (["--tls-cert", str(ours.server_cert), "--tls-key", str(rogue.server_key)],
                           "are not a PEM certificate and its unencrypted private key"),
        "ca not PEM": (["--tls-cert", str(ours.server_cert), "--tls-key", str(ours.server_key),
                        "--tls-client-ca", str(junk)], "holds no PEM certificate"),
    }[case]
    proc = subprocess.run(
        [sys.executable, "-m", "vaed.cli", "serve", "--device", "cpu", "--host", "127.0.0.1", "--port", "0",
         "--model", "random:wan2.1-tiny", "--no-warmup", *flags],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "could not bind" not in proc.stderr, proc.stderr

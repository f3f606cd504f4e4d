"""Reference computations for the end-to-end tests: diffusers itself."""

from __future__ import annotations

from typing import Any

import torch


def rgb8(decoded: torch.Tensor) -> torch.Tensor:
    """DESIGN.md's RGB8 postprocess of a clamped decoder output [B, 3, T, H, W] -> [B, T, H, W, 3]."""
    return ((decoded.float() * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1)


def denormalize(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """What WanPipeline does to output_type='latent' latents before vae.decode."""
    z = vae.config.z_dim
    latents = latents.to(vae.device, vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = (1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)).to(latents.device, latents.dtype)
    return latents / inv_std + mean


@torch.no_grad()
def diffusers_decode(vae: Any, latents: torch.Tensor, *, raw_latents: bool) -> torch.Tensor:
    z = latents.to(vae.device, vae.dtype) if raw_latents else denormalize(vae, latents)
    return vae.decode(z, return_dict=False)[0].cpu()


def self_signed_pem(host: str = "localhost") -> tuple[bytes, bytes]:
    """A self-signed EC cert valid for `host` and 127.0.0.1, as (cert PEM, key PEM)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(host), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def write_self_signed(directory: Any, host: str = "localhost") -> tuple[Any, Any]:
    """`self_signed_pem` written to directory/tls.crt and tls.key (0600); returns the two paths."""
    import os

    cert_pem, key_pem = self_signed_pem(host)
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(cert_pem)
    key_path.write_bytes(key_pem)
    os.chmod(key_path, 0o600)
    return cert_path, key_path

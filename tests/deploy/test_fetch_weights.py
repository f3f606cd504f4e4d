"""scripts/fetch_weights.py: fetches vae/ only, decides completeness from the
files themselves, copies offline atomically, and is a no-op on a complete folder."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from harness import load_script


@pytest.fixture(scope="module")
def fw() -> ModuleType:
    return load_script("scripts/fetch_weights.py")


def make_vae(folder: Path, z_dim: int = 16, cls: str = "AutoencoderKLWan") -> Path:
    """A pipeline folder with a small but well-formed vae/ (real safetensors file)."""
    from safetensors.numpy import save_file

    vae = folder / "vae"
    vae.mkdir(parents=True, exist_ok=True)
    (vae / "config.json").write_text(json.dumps({"_class_name": cls, "z_dim": z_dim}))
    save_file({"decoder.conv_in.weight": np.ones((4, 4), np.float32), "post_quant_conv.bias": np.zeros(4, np.float32)},
              str(vae / "diffusion_pytorch_model.safetensors"))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    return folder


def test_verify_accepts_pipeline_folder_and_vae_folder(fw: ModuleType, tmp_path: Path) -> None:
    src = make_vae(tmp_path / "m", z_dim=48)
    assert fw.verify(src)["z_dim"] == 48
    assert fw.verify(src / "vae")["z_dim"] == 48
    assert set(fw.verify(src)["files"]) == {"vae/config.json", "vae/diffusion_pytorch_model.safetensors"}


@pytest.mark.parametrize("damage", ["truncate", "no_config", "wrong_class", "no_weights", "garbage_header"])
def test_verify_rejects_incomplete(fw: ModuleType, tmp_path: Path, damage: str) -> None:
    src = make_vae(tmp_path / "m")
    weights = src / "vae" / "diffusion_pytorch_model.safetensors"
    if damage == "truncate":  # a download cut off half way
        weights.write_bytes(weights.read_bytes()[:-3])
    elif damage == "no_config":
        (src / "vae" / "config.json").unlink()
    elif damage == "wrong_class":
        (src / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    elif damage == "no_weights":
        weights.unlink()
    else:
        weights.write_bytes(b"\xff" * 64)
    with pytest.raises(fw.WeightsError):
        fw.verify(src)
    assert fw.main(["--check", "--dest", str(src)]) == 1


def test_from_dir_copies_vae_only_and_second_run_is_noop(fw: ModuleType, tmp_path: Path) -> None:
    src = make_vae(tmp_path / "src")
    (src / "transformer").mkdir()
    (src / "transformer" / "big.safetensors").write_bytes(b"x" * 1000)  # must not be copied
    dest = tmp_path / "models" / "Wan2.1-T2V-1.3B-Diffusers"
    assert fw.main(["--from-dir", str(src), "--dest", str(dest)]) == 0
    assert fw.main(["--check", "--dest", str(dest), "--expect-z-dim", "16"]) == 0
    assert not (dest / "transformer").exists()
    assert (dest / "model_index.json").is_file()
    assert not list(dest.glob(".vae.*"))  # staging folders cleaned up
    provenance = json.loads((dest / fw.PROVENANCE).read_text())
    assert provenance["source"] == f"dir:{src}"
    stamp = (dest / "vae" / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns
    assert fw.main(["--from-dir", str(src), "--dest", str(dest)]) == 0
    assert (dest / "vae" / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns == stamp


def test_from_incomplete_dir_refused(fw: ModuleType, tmp_path: Path) -> None:
    src = make_vae(tmp_path / "src")
    (src / "vae" / "config.json").unlink()
    dest = tmp_path / "dest"
    assert fw.main(["--from-dir", str(src), "--dest", str(dest)]) == 1
    assert not (dest / "vae").exists()


def test_hub_download_asks_for_vae_only(fw: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    calls: list[dict[str, object]] = []

    def fake_snapshot_download(**kwargs: object) -> str:
        calls.append(kwargs)
        make_vae(Path(str(kwargs["local_dir"])))  # what the hub would write there
        return str(kwargs["local_dir"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    dest = tmp_path / "Wan2.1-T2V-1.3B-Diffusers"
    argv = ["--repo", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "--dest", str(dest)]
    assert fw.main(argv) == 0
    assert len(calls) == 1
    assert calls[0]["repo_id"] == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    assert calls[0]["allow_patterns"] == ["vae/*", "model_index.json"]
    assert Path(str(calls[0]["local_dir"])) == dest
    # Complete: the next run (every `kubectl apply` re-creates the Job) touches no network.
    assert fw.main(argv) == 0
    assert len(calls) == 1
    assert fw.main([*argv, "--force"]) == 0
    assert len(calls) == 2


def test_hub_failure_is_one_clear_error(fw: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    import huggingface_hub

    def offline(**kwargs: object) -> str:
        raise ConnectionError("no route to host")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    assert fw.main(["--repo", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "--dest", str(tmp_path / "m")]) == 1
    assert "no route to host" in caplog.text


def test_check_waits_then_fails_or_passes(fw: ModuleType, tmp_path: Path) -> None:
    dest = tmp_path / "m"
    assert fw.main(["--check", "--dest", str(dest), "--wait", "0.2", "--poll", "0.05"]) == 1
    make_vae(dest, z_dim=48)
    assert fw.main(["--check", "--dest", str(dest), "--wait", "5"]) == 0
    # The wrong model on the volume is caught before the server starts.
    assert fw.main(["--check", "--dest", str(dest), "--expect-z-dim", "16"]) == 1


def test_arguments(fw: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        fw.main(["--dest", str(tmp_path)])  # no source and no --check
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        fw.main(["--dest", str(tmp_path), "--repo", "a/b", "--check"])  # mutually exclusive


def test_real_diffusers_vae_folder(fw: ModuleType, tmp_path: Path) -> None:
    """What diffusers' save_pretrained writes passes, is copied, and loads back."""
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    from vaed.models import RANDOM_CONFIGS

    vae = diffusers.AutoencoderKLWan(**RANDOM_CONFIGS["wan2.1-tiny"])
    vae.save_pretrained(str(tmp_path / "src" / "vae"))
    dest = tmp_path / "models" / "Wan2.1-T2V-1.3B-Diffusers"
    assert fw.main(["--from-dir", str(tmp_path / "src"), "--dest", str(dest)]) == 0
    assert fw.verify(dest)["z_dim"] == RANDOM_CONFIGS["wan2.1-tiny"]["z_dim"]
    loaded = diffusers.AutoencoderKLWan.from_pretrained(str(dest), subfolder="vae")
    for (k, a), (_, b) in zip(vae.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k

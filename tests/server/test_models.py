"""Model specs: random architectures, local diffusers folders, clear load errors."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from vaed.errors import ModelLoadError
from vaed.models import (
    RANDOM_CONFIGS,
    SHAPE_FIELDS,
    build_random_vae,
    kernel_family,
    load_model,
    looks_like_path,
    parse_random_spec,
    weights_digest,
)


def test_random_spec_parsing():
    assert parse_random_spec("random:wan2.1") == ("wan2.1", 0)
    assert parse_random_spec("random:wan2.2?seed=7") == ("wan2.2", 7)
    with pytest.raises(ModelLoadError, match="unknown random architecture"):
        parse_random_spec("random:wan9")
    with pytest.raises(ModelLoadError, match="seed"):
        parse_random_spec("random:wan2.1?seed=x")
    with pytest.raises(ModelLoadError, match="only"):
        parse_random_spec("random:wan2.1?bias=1")


def test_random_weights_are_seeded_like_diffusers():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(3)
    expected = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 0.5, 2.0, 0.8])
    got = build_random_vae("wan2.1-tiny", seed=3)
    for (name, a), (_, b) in zip(expected.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), name
    other = build_random_vae("wan2.1-tiny", seed=4)
    assert not torch.equal(other.decoder.conv_in.weight, got.decoder.conv_in.weight)


def test_wan22_architecture_config():
    vae = load_model("random:wan2.2", "cpu", torch.float32).vae
    cfg = vae.config
    assert (cfg.z_dim, cfg.patch_size, cfg.scale_factor_spatial, cfg.is_residual) == (48, 2, 16, True)
    assert len(cfg.latents_mean) == 48 and cfg.latents_std[0] == pytest.approx(0.4765)


@pytest.mark.parametrize("point_at", ["root", "vae"])
def test_local_folder_saved_with_save_pretrained(tmp_path, point_at):
    original = build_random_vae("wan2.2-tiny", seed=5)
    original.save_pretrained(tmp_path / "vae")
    loaded = load_model(str(tmp_path if point_at == "root" else tmp_path / "vae"), "cpu", torch.float32)
    assert not loaded.random_weights
    for (name, a), (_, b) in zip(original.state_dict().items(), loaded.vae.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_folder_whose_weights_lack_tensors_is_refused_and_extra_ones_are_named(tmp_path, caplog):
    """diffusers fills a tensor its weights file lacks with whatever memory it got (and prints a
    line): a damaged file would serve noise, each replica with its own weights digest."""
    from safetensors.torch import load_file, save_file

    build_random_vae("wan2.1-tiny").save_pretrained(tmp_path / "vae")
    weights = tmp_path / "vae" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(weights))
    kept = {k: v for k, v in tensors.items() if not k.startswith("decoder.conv_in.")}
    save_file(kept, str(weights))
    with pytest.raises(ModelLoadError, match=r"its weights lack 2 of the model's tensors \(decoder\.conv_in\."):
        load_model(str(tmp_path), "cpu", torch.float32)
    save_file({**tensors, "decoder.spare.weight": torch.zeros(2)}, str(weights))
    with caplog.at_level("WARNING", logger="vaed.models"):
        loaded = load_model(str(tmp_path), "cpu", torch.float32)
    assert "1 tensors the model does not use (decoder.spare.weight)" in caplog.text
    assert torch.equal(loaded.vae.decoder.conv_in.weight, tensors["decoder.conv_in.weight"])


@pytest.mark.parametrize("damage", ["truncated weights", "config not JSON", "no weights"])
def test_a_damaged_folder_is_one_load_error_naming_it(tmp_path, damage):
    """What diffusers raises for a damaged folder (many types, long chains) comes out as one
    ModelLoadError naming the folder and the cause, which the server logs as one line."""
    build_random_vae("wan2.1-tiny").save_pretrained(tmp_path / "vae")
    weights = tmp_path / "vae" / "diffusion_pytorch_model.safetensors"
    if damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "config not JSON":
        (tmp_path / "vae" / "config.json").write_text("{not json")
    else:
        weights.unlink()
    with pytest.raises(ModelLoadError, match=r"diffusers could not load the VAE in .*vae \(\w+Error: ") as failure:
        load_model(str(tmp_path), "cpu", torch.float32)
    assert "\n" not in str(failure.value) and failure.value.__cause__ is None


def test_a_folder_of_another_model_class_is_refused_by_name(tmp_path):
    """An image VAE's folder (`AutoencoderKL`) is no Wan VAE: one ModelLoadError naming both
    classes, where loading it anyway failed with a state-dict error naming no cause."""
    build_random_vae("wan2.1-tiny").save_pretrained(tmp_path / "vae")
    config = tmp_path / "vae" / "config.json"
    config.write_text(config.read_text().replace('"AutoencoderKLWan"', '"AutoencoderKL"'))
    with pytest.raises(ModelLoadError, match=r"describes a AutoencoderKL, not a Wan video VAE \(AutoencoderKLWan\)"):
        load_model(str(tmp_path), "cpu", torch.float32)


def test_weights_digests_name_the_loaded_weights_wherever_they_are_made(tmp_path):
    """A replica's identity starts with these: equal for a save_pretrained folder and the model
    it was saved from, in any compute dtype (taken before the cast), and from the digest thread a
    GPU load uses; another seed differs."""
    from vaed import models

    original = build_random_vae("wan2.2-tiny", seed=5)
    original.save_pretrained(tmp_path / "vae")
    want = {half: weights_digest(original, half) for half in ("decoder", "encoder")}
    loaded = load_model(str(tmp_path), "cpu", torch.bfloat16)
    assert {half: made.result() for half, made in loaded.digests.items()} == want
    threaded = models._digests(original, ["decoder", "encoder"], torch.device("cuda"))  # submits only
    assert {half: made.result() for half, made in threaded.items()} == want
    assert weights_digest(build_random_vae("wan2.2-tiny", seed=6), "decoder") != want["decoder"]
    assert load_model("random:wan2.2-tiny?seed=5", "cpu", torch.float32, decoder_only=True).digests.keys() == {
        "decoder"}


@pytest.mark.parametrize("arch", ["wan2.1-tiny", "wan2.2-tiny"])
def test_a_saved_folder_is_of_the_kernel_family_its_config_gives(tmp_path, arch):
    """A server compiles ahead only the kernel records of its model's family, read from the
    folder's config.json before the model loads."""
    build_random_vae(arch).save_pretrained(tmp_path / "vae")
    assert kernel_family(str(tmp_path)) == kernel_family(str(tmp_path / "vae")) == arch
    config = json.loads((tmp_path / "vae" / "config.json").read_text())
    (tmp_path / "vae" / "config.json").write_text(json.dumps({**config, "base_dim": 12}))
    assert kernel_family(str(tmp_path)) is None  # shapes of no known family


def test_a_hub_id_in_the_local_hub_cache_is_of_its_configs_kernel_family(tmp_path):
    """`vaed serve`'s default model is a hub id: its config.json comes from the hub cache (no
    network), as huggingface_hub lays it out; read in a fresh process, which takes
    HF_HUB_CACHE from its environment."""
    repo = tmp_path / "models--acme--wan-vae"
    build_random_vae("wan2.2-tiny").save_pretrained(repo / "snapshots" / "0123abc" / "vae")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    probe = "from vaed.models import kernel_family as f; print(f('acme/wan-vae'), f('acme/other'))"
    out = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, HF_HUB_CACHE=str(tmp_path)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["wan2.2-tiny", "None"]


def test_kernel_families_of_specs_without_a_folder():
    assert [kernel_family(s) for s in ("random:wan2.1", "random:wan2.2?seed=4", "random:wan9")] == [
        "wan2.1", "wan2.2", None]
    assert kernel_family("no-such-namespace/no-such-model") is None  # not in the local hub cache
    assert kernel_family("./missing-folder") is None


def test_the_shape_fields_defaults_are_diffusers_own():
    """`kernel_family` fills a config's missing shape fields with these: AutoencoderKLWan's defaults."""
    from diffusers import AutoencoderKLWan

    signature = inspect.signature(AutoencoderKLWan.__init__).parameters
    assert {name: signature[name].default for name in SHAPE_FIELDS} == SHAPE_FIELDS
    assert set().union(*RANDOM_CONFIGS.values()) - set(SHAPE_FIELDS) <= {
        "latents_mean", "latents_std", "scale_factor_spatial"}  # no shape field left out


def test_folder_without_vae_names_what_it_expected(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path), "cpu", torch.float32)


def test_serve_without_weights_exits_naming_both_ways_out():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "vaed.cli", "serve", "--device", "cpu", "--port", "0", "--host", "127.0.0.1",
         "--model", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode != 0
    assert "random:wan2.1" in proc.stderr and "local diffusers folder" in proc.stderr
    assert proc.stderr.count("could not load VAE weights") == 1, proc.stderr  # logged once


@pytest.mark.parametrize("spec", ["/no/such/Wan2.1-T2V-1.3B-Diffusers", "./models/wan21", "~/no-such-vae"])
def test_serve_with_a_missing_folder_says_so_without_trying_the_hub(spec):
    """A path-like --model that does not exist is a typo, not a hub id: the process exits
    saying "no such folder" (once) and how to try vaed without weights."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    proc = subprocess.run(
        [sys.executable, "-m", "vaed.cli", "serve", "--device", "cpu", "--port", "0", "--host", "127.0.0.1",
         "--model", spec],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.count("no such folder") == 1, proc.stderr
    assert "hub failed" not in proc.stderr and "huggingface.co" not in proc.stderr
    assert "random:wan2.1-tiny" in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr


def test_a_missing_folder_under_a_local_one_is_no_hub_id(tmp_path):
    """`mymodels/wan21` beside an existing `mymodels/` is a typo'd path: "no such folder" at
    once, no hub attempts (they took ~26 s), though the spec has a hub id's shape."""
    (tmp_path / "mymodels").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    proc = subprocess.run(
        [sys.executable, "-m", "vaed.cli", "serve", "--device", "cpu", "--port", "0", "--host", "127.0.0.1",
         "--model", "mymodels/wan21"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.count("no such folder") == 1, proc.stderr
    assert "hub failed" not in proc.stderr and "huggingface.co" not in proc.stderr


@pytest.mark.parametrize(("spec", "path_like"), [
    ("/models/wan", True), ("./wan", True), ("../wan", True), ("~/wan", True), ("a/b/c", True), ("wan/", True),
    ("C:\\models\\wan", True), ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", False), ("gpt2", False),
])
def test_which_specs_look_like_folders(spec, path_like):
    assert looks_like_path(spec) is path_like


def test_decoder_only_drops_the_encoder_and_keeps_the_decoder():
    full = load_model("random:wan2.1-tiny", "cpu", torch.float32).vae
    served = load_model("random:wan2.1-tiny", "cpu", torch.float32, decoder_only=True).vae
    assert served.encoder is None and served.quant_conv is None
    assert torch.equal(served.decoder.conv_out.weight, full.decoder.conv_out.weight)


def test_concurrent_first_imports_of_the_vae_class_all_succeed():
    """diffusers' lazy import fails in some of eight threads importing AutoencoderKLWan at
    once (5 of 8 here without the lock; one of two GPU workers on two H200s):
    `models.autoencoder_class` imports under a lock. Fresh interpreter: first import."""
    import subprocess
    import sys

    script = (
        "import threading\n"
        "from vaed.models import autoencoder_class\n"
        "errors = []\n"
        "def load():\n"
        "    try:\n"
        "        assert autoencoder_class().__name__ == 'AutoencoderKLWan'\n"
        "    except Exception as exc:\n"
        "        errors.append(repr(exc))\n"
        "threads = [threading.Thread(target=load) for _ in range(8)]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "print('errors', len(errors), errors[:1])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "errors 0 []" in out.stdout, out.stdout

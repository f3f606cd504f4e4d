"""vaed bench on the CPU with a tiny model: table, JSON, bit-identical flags."""

from __future__ import annotations

import argparse
import json

import pytest

from vaed import bench


def test_parse_case() -> None:
    c = bench.parse_case("wan2.2:704x1280x121")
    assert (c.arch, c.height, c.width, c.frames) == ("wan2.2", 704, 1280, 121)
    assert bench.parse_case("480x832x81").arch == "wan2.1"
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_case("480x832")
    # what only failed once the case ran, with a traceback
    with pytest.raises(argparse.ArgumentTypeError, match="frames must be 1 \\+ 4k"):
        bench.parse_case("wan2.1-tiny:64x64x18")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown architecture 'wan2.5'"):
        bench.parse_case("wan2.5:64x64x17")


def test_bench_cpu_tiny(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "b.json"
    args = parser.parse_args(["--device", "cpu", "--dtype", "fp32", "--case", "wan2.1-tiny:32x32x9",
                              "--reps", "1", "--json", str(out)])
    assert bench.run(args) == 0
    text = capsys.readouterr().out
    assert "[bench]" in text and "vaed-lossless" in text
    rows = json.loads(out.read_text())["rows"]
    # every variant but the fast tier, whose Triton op set needs CUDA (skipped with a warning)
    assert [r["variant"] for r in rows] == [v for v in bench.VARIANTS if v != "vaed-fast"]
    assert rows[2]["bit_identical"] == "yes"


def test_bench_encode_cpu_tiny(tmp_path, capsys) -> None:
    """--op encode: stock per layout, then the engine's encode, whose moments equal stock-cl3d's."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "e.json"
    args = parser.parse_args(["--op", "encode", "--device", "cpu", "--dtype", "fp32", "--case",
                              "wan2.2-tiny:64x96x9", "--reps", "1", "--json", str(out)])
    assert bench.run(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["stock", "stock-cl3d", "vaed-lossless"]
    assert [r["bit_identical"] for r in rows] == ["ref", "ref", "yes"]
    assert rows[0]["case"] == "wan2.2-tiny 64x96x9 encode"


def test_bench_rejects_unknown_variant() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--device", "cpu", "--variants", "nope"])) == 2


def test_bench_refuses_a_device_and_a_json_folder_that_do_not_exist_before_any_case(tmp_path, caplog,
                                                                                   capsys) -> None:
    """A torch device name that is none, and --json into no folder (checked first: it failed with
    a traceback after every case had run)."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    case = ["--case", "wan2.1-tiny:32x32x9", "--dtype", "fp32", "--reps", "1"]
    assert bench.run(parser.parse_args(["--device", "xyz", *case])) == 2
    assert "--device xyz" in caplog.text
    assert bench.run(parser.parse_args(["--device", "cpu", "--json", str(tmp_path / "no" / "b.json"), *case])) == 2
    assert "no such folder" in caplog.text and "[bench]" not in capsys.readouterr().out  # no case ran


def test_sides_that_are_no_multiple_of_the_scale_are_a_usage_error(tmp_path, caplog) -> None:
    """A side that no latent grid gives failed with a ValueError traceback after the model loaded;
    now argparse refuses it, with the architecture's factor (8, Wan2.2's 16)."""
    with pytest.raises(argparse.ArgumentTypeError, match="multiples of 8 for wan2.1-tiny, got 64x60"):
        bench.parse_case("wan2.1-tiny:64x60x17")
    with pytest.raises(argparse.ArgumentTypeError, match="multiples of 16 for wan2.2-tiny, got 64x72"):
        bench.parse_case("wan2.2-tiny:64x72x17")
    assert bench.parse_case("wan2.2-tiny:64x96x17").width == 96
    parser = argparse.ArgumentParser(prog="vaed bench")
    bench.add_arguments(parser)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--device", "cpu", "--case", "wan2.1-tiny:64x60x17"])
    assert exited.value.code == 2
    # a --model whose factor differs from the case's architecture's is known only once it loaded
    args = parser.parse_args(["--device", "cpu", "--dtype", "fp32", "--model", "random:wan2.2-tiny",
                              "--case", "wan2.1-tiny:32x40x9", "--reps", "1"])
    assert bench.run(args) == 2
    assert "multiples of 16 for this model" in caplog.text

"""vaed_client.export_video: every frame form in, never mis-scaled, lossless
containers bit-exact."""

from __future__ import annotations

import pathlib

import av
import numpy as np
import pytest
import torch
from PIL import Image

from harness import fake_video
from vaed_client import export_video
from vaed_client.export import ExportError, to_uint8_video


def _frames(path: pathlib.Path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


VIDEO = fake_video(1, 5, 32, 48)[0]  # uint8 [T, H, W, 3]


def test_uint8_is_never_multiplied_again(tmp_path: pathlib.Path) -> None:
    # The bug vaed fixes: diffusers' export_to_video scales uint8 by 255 again.
    path = export_video(VIDEO, tmp_path / "v.mkv")
    assert np.array_equal(_frames(path), VIDEO)


@pytest.mark.parametrize("form", ["np", "pt", "pil", "torch_uint8", "batched_np", "pil_nested"])
def test_every_form_gives_the_same_frames(tmp_path: pathlib.Path, form: str) -> None:
    unit = VIDEO.astype(np.float32) / 255
    frames = {
        "np": unit,
        "pt": torch.from_numpy(unit).permute(0, 3, 1, 2),  # diffusers pt: [T, 3, H, W]
        "pil": [Image.fromarray(f) for f in VIDEO],
        "torch_uint8": torch.from_numpy(VIDEO),
        "batched_np": unit[None],
        "pil_nested": [[Image.fromarray(f) for f in VIDEO]],
    }[form]
    assert np.array_equal(to_uint8_video(frames), VIDEO)
    assert np.array_equal(_frames(export_video(frames, tmp_path / "v.mkv")), VIDEO)


def test_float_frames_that_look_like_uint8_raise() -> None:
    with pytest.raises(ExportError, match=r"\[0, 1\]"):
        to_uint8_video(VIDEO.astype(np.float32))
    with pytest.raises(ExportError, match="one"):
        to_uint8_video(np.zeros((2, 3, 8, 8, 3), np.uint8))


def test_containers(tmp_path: pathlib.Path) -> None:
    assert np.array_equal(_frames(export_video(VIDEO, tmp_path / "a.mp4", lossless=True)), VIDEO)
    lossy = _frames(export_video(VIDEO, tmp_path / "b.mp4", fps=8))
    assert lossy.shape == VIDEO.shape and not np.array_equal(lossy, VIDEO)
    folder = export_video(VIDEO, tmp_path / "png")
    assert np.array_equal(np.asarray(Image.open(folder / "frame_00004.png")), VIDEO[4])
    with pytest.raises(ExportError, match=".mkv"):
        export_video(VIDEO, tmp_path / "x.webm")


def test_a_shorter_export_into_a_png_folder_leaves_only_its_own_frames(tmp_path: pathlib.Path) -> None:
    """export_video overwrites, as for a file: 17 frames then 5 left 17 files, 12 of them from
    the first video. Only the writer's own frame_NNNNN.png names go; other files stay."""
    folder = tmp_path / "png"
    long = fake_video(1, 17, 16, 24)[0]
    export_video(long, folder)
    (folder / "notes.txt").write_text("mine")
    (folder / "frame_x.png").write_bytes(b"not one of ours")
    (folder / "frame_0001.png").write_bytes(b"four digits: not one of ours")
    export_video(VIDEO, str(folder) + "/")
    assert sorted(p.name for p in folder.glob("frame_?????.png")) == [f"frame_{i:05d}.png" for i in range(5)]
    assert np.array_equal(np.asarray(Image.open(folder / "frame_00004.png")), VIDEO[4])
    assert (folder / "notes.txt").read_text() == "mine" and (folder / "frame_x.png").exists()
    assert (folder / "frame_0001.png").exists()
    with pytest.raises(ExportError, match="one"):  # a refused call removes nothing
        export_video(np.zeros((2, 3, 8, 8, 3), np.uint8), folder)
    assert len(list(folder.glob("frame_?????.png"))) == 5


def test_export_makes_missing_folders_and_refuses_a_file_in_the_way(tmp_path: pathlib.Path) -> None:
    assert np.array_equal(_frames(export_video(VIDEO, tmp_path / "a" / "b" / "v.mkv")), VIDEO)
    (tmp_path / "file").write_text("x")
    for out in ("v.mkv", "v.mp4", "png/"):
        with pytest.raises(ExportError, match="is a file, not a folder"):
            export_video(VIDEO, str(tmp_path / "file" / "deeper" / out))

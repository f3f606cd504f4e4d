"""The HTTP front's page at GET / in a real headless browser (Debian's chromium + chromium-driver,
driven by selenium): it shows the model and the live load, decodes random and uploaded latents
(.npy, .safetensors, .pt) through the streaming fMP4 route, and plays the video through Media
Source Extensions while the decode is still running. Without a browser: the status route's and the
.pt conversion route's auth, limits and bad input.

The browser is part of the default run (CI installs it, see .ci/run): a missing chromium fails these
tests with the command that installs it, because a skip would hide that the page went untested.
VAED_SKIP_BROWSER_TESTS=1 opts out explicitly (a machine without the browser). The screenshot of a
played decode goes to $VAED_TEST_ARTIFACTS when set (else the test's tmp_path); its path is printed.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re
import shutil
import socket
import threading
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import requests
import torch
from diffusers.utils.remote_utils import remote_decode
from safetensors.torch import save_file
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from harness import RunningServer, make_config, serve_in_thread, start_cli_server
from vaed.server import engine_factory
from vaed.video import Fmp4Packager, VideoOptions

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
MODEL = "random:wan2.1-tiny"
Z, SCALE_T, SCALE_S = 4, 4, 8  # the tiny Wan2.1's z_dim and scale factors
WAIT_S = 120  # every browser wait: conditions, never a machine-speed guess
TOKEN = "page-token"

# What the page's player exposes (window.vaedPage) and the video element's state, in one read.
PLAYER_STATE = """
const p = window.vaedPage, v = document.getElementById('video');
return {state: p.state, error: p.error, mime: p.mime, firstFrameMs: p.firstFrameMs, doneMs: p.doneMs, bytes: p.bytes,
        framesShown: p.framesShown, expected: p.expected, currentTime: v.currentTime, readyState: v.readyState,
        width: v.videoWidth, height: v.videoHeight, ended: v.ended,
        decodedFrames: v.getVideoPlaybackQuality().totalVideoFrames};
"""

# The load table's cells, read in one script: the page replaces its rows at every poll, so a cell
# found by selenium could go stale before its text is read.
LOAD_CELLS = "return [...document.querySelectorAll('#load tbody td')].map((td) => td.textContent)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the browser ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    if os.environ.get("VAED_SKIP_BROWSER_TESTS") == "1":
        pytest.skip("VAED_SKIP_BROWSER_TESTS=1: the page's browser tests were opted out")
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if shutil.which(path) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: install the browser with `apt-get install -y chromium "
                    "chromium-driver` (Debian), or opt out with VAED_SKIP_BROWSER_TESTS=1", pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # --disable-background-networking & co.: no connection leaves the machine (they are refused here)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--autoplay-policy=no-user-gesture-required", "--window-size=1200,1000",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_script_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: webdriver.Chrome, condition: Callable[[], Any], what: str) -> Any:
    """`condition()`'s first truthy value; a page error or WAIT_S seconds fail with the player's state."""
    def check(_: Any) -> Any:
        state = driver.execute_script(PLAYER_STATE)
        if state["state"] == "error":
            raise AssertionError(f"the page reports an error: {state['error']}")
        return condition()

    try:
        return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(check)
    except TimeoutException:
        raise AssertionError(f"{what}: not within {WAIT_S} s; player: {driver.execute_script(PLAYER_STATE)}") from None


def player(driver: webdriver.Chrome) -> dict[str, Any]:
    return driver.execute_script(PLAYER_STATE)


def open_page(driver: webdriver.Chrome, port: int) -> None:
    driver.get(f"http://127.0.0.1:{port}/")
    wait_for(driver, lambda: MODEL in driver.find_element(By.ID, "model-name").text, "the page shows the model")


def set_random_shape(driver: webdriver.Chrome, t: int, h: int, w: int) -> None:
    driver.find_element(By.CSS_SELECTOR, "input[name=source][value=random]").click()
    for field, value in (("lat-t", t), ("lat-h", h), ("lat-w", w)):
        element = driver.find_element(By.ID, field)
        element.clear()
        element.send_keys(str(value))


def played_to_the_end(driver: webdriver.Chrome) -> dict[str, Any]:
    return wait_for(driver, lambda: (s := player(driver))["state"] == "done" and s["ended"] and s, "played to the end")


def page_mp4(driver: webdriver.Chrome) -> bytes:
    """The bytes the page received (its Blob), read back through a data: URL."""
    data_url = driver.execute_async_script("""
        const done = arguments[arguments.length - 1], reader = new FileReader();
        reader.onload = () => done(reader.result);
        reader.readAsDataURL(window.vaedPage.mp4);""")
    return base64.b64decode(data_url.split(",", 1)[1])


def frames_of_mp4(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])])


def mime_for(height: int, width: int) -> str:
    """The MediaSource type vaed's encoder gives a video of this size (its SPS's profile and level)."""
    packager = Fmp4Packager(VideoOptions(fps=16))
    packager.add(np.zeros((1, height, width, 3), np.uint8))
    assert packager.mime_type is not None
    return packager.mime_type


# -- vaed serve, the page, a random decode -----------------------------------------------------------


@pytest.fixture(scope="module")
def served() -> Iterator[int]:
    """A `vaed serve --http-port` subprocess; yields the HTTP port."""
    port = _free_port()
    proc, _ = start_cli_server("--http-port", str(port))
    try:
        yield port
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_page_plays_a_random_decode(browser: webdriver.Chrome, served: int, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    t, h, w = 5, 16, 16
    height, width, frames = h * SCALE_S, w * SCALE_S, 1 + SCALE_T * (t - 1)
    open_page(browser, served)
    assert browser.find_element(By.ID, "serving").text == "SERVING"
    # H.264 through MSE first: a browser built without it must fail here, loudly
    mime = mime_for(height, width)
    assert browser.execute_script("return MediaSource.isTypeSupported(arguments[0])", mime), \
        f"this chromium's Media Source Extensions do not play {mime} (a build without H.264?)"
    set_random_shape(browser, t, h, w)
    browser.find_element(By.ID, "decode").click()
    state = played_to_the_end(browser)
    assert state["mime"] == mime  # the page read the codec from the init segment as the encoder wrote it
    assert (state["width"], state["height"]) == (width, height)
    assert state["expected"] == {"frames": frames, "width": width, "height": height}
    assert state["decodedFrames"] == frames and state["framesShown"] >= 1
    assert state["currentTime"] > 0 and state["readyState"] >= 2  # HAVE_CURRENT_DATA
    assert state["firstFrameMs"] is not None and state["firstFrameMs"] > 0
    assert browser.find_element(By.ID, "first-frame").text.endswith(" ms")
    assert frames_of_mp4(page_mp4(browser)).shape == (frames, height, width, 3)
    artifacts = Path(os.environ.get("VAED_TEST_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "http_page.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 0
    with capsys.disabled():
        print(f"\npage screenshot: {shot} (first frame {state['firstFrameMs']:.0f} ms, "
              f"stream done {state['doneMs']:.0f} ms)")


def _upload(driver: webdriver.Chrome, path: Path) -> None:
    driver.find_element(By.ID, "file").send_keys(str(path))  # its change event selects "file"
    assert driver.find_element(By.CSS_SELECTOR, "input[name=source][value=file]").is_selected()
    driver.find_element(By.ID, "decode").click()


def _save_npy(path: Path, x: torch.Tensor) -> None:
    np.save(path, x.numpy())


def _save_safetensors(path: Path, x: torch.Tensor) -> None:
    save_file({"latents": x, "other": torch.zeros(2)}, str(path))  # two tensors: the page takes "latents"


def _save_pt(path: Path, x: torch.Tensor) -> None:
    torch.save({"latents": x, "step": 50}, path)


@pytest.mark.parametrize(("suffix", "dtype", "save"), [
    (".npy", torch.float32, _save_npy),
    (".npy", torch.float64, _save_npy),  # the page converts numpy's default to float32
    (".safetensors", torch.bfloat16, _save_safetensors),
    (".pt", torch.float16, _save_pt),  # read by the server's torch.load (POST /v1/convert/pt)
])
def test_an_uploaded_file_decodes_as_remote_decode_does(
    browser: webdriver.Chrome, served: int, tmp_path: Path, suffix: str, dtype: torch.dtype,
    save: Callable[[Path, torch.Tensor], None],
) -> None:
    """The page's video of an uploaded file has exactly the frames of diffusers' remote_decode of the
    same tensor: a wrong byte, shape or dtype in the page's reading would decode other frames."""
    x = torch.randn(1, Z, 3, 4, 6, generator=torch.Generator().manual_seed(11)).to(dtype)
    path = tmp_path / f"latents{suffix}"
    save(path, x[0] if suffix == ".pt" else x)  # a 4-D [z, T, h, w] is one video too
    open_page(browser, served)
    _upload(browser, path)
    state = played_to_the_end(browser)
    sent = x.float() if dtype == torch.float64 else x
    want = remote_decode(endpoint=f"http://127.0.0.1:{served}/", tensor=sent, output_type="mp4", return_type="mp4")
    assert (state["width"], state["height"]) == (6 * SCALE_S, 4 * SCALE_S)
    assert np.array_equal(frames_of_mp4(page_mp4(browser)), frames_of_mp4(want))


def test_a_bad_file_is_reported_on_the_page(browser: webdriver.Chrome, served: int, tmp_path: Path) -> None:
    path = tmp_path / "latents.npy"
    path.write_bytes(b"not numpy at all")
    open_page(browser, served)
    _upload(browser, path)
    WebDriverWait(browser, WAIT_S).until(lambda d: player(d)["state"] == "error")
    assert "not a .npy file" in browser.find_element(By.ID, "player-error").text
    matrix = tmp_path / "matrix.pt"
    torch.save(torch.zeros(2, 3), matrix)
    _upload(browser, matrix)
    WebDriverWait(browser, WAIT_S).until(lambda d: "latents are [B, z, T, h, w]" in
                                         d.find_element(By.ID, "player-error").text)
    # truncated files are said to be so, not a JavaScript error of the parser's
    truncated = tmp_path / "truncated.npy"
    np.save(truncated, np.zeros((1, Z, 2, 4, 6)))
    truncated.write_bytes(truncated.read_bytes()[:-5])
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    cut = tmp_path / "cut.safetensors"
    save_file({"latents": torch.zeros(1, Z, 2, 4, 6)}, str(cut))
    cut.write_bytes(cut.read_bytes()[:-8])
    for path, message in ((truncated, "(a truncated file?)"), (empty, "not a .safetensors file"),
                          (cut, "(a truncated .safetensors?)")):
        _upload(browser, path)
        WebDriverWait(browser, WAIT_S).until(lambda d, message=message: message in
                                             d.find_element(By.ID, "player-error").text)


# -- playing while the decode runs -------------------------------------------------------------------


def held_at_frame_3(config: Any, held: threading.Event, release: threading.Event) -> Callable[[str], Any]:
    """An engine factory whose decode of latent frame 3 sets `held` and waits for `release`."""
    def build(device: str) -> Any:
        engine = engine_factory(config)(device)
        decode_frame = engine.decode_frame

        def held_decode(state: Any, latent_frame: torch.Tensor, output: Any) -> Any:
            group = decode_frame(state, latent_frame, output)
            if group.chunk_index == 3:
                held.set()
                assert release.wait(WAIT_S), "latent frame 3 was never released"
            return group

        engine.decode_frame = held_decode
        return engine

    return build


def test_the_page_plays_while_the_decode_runs(browser: webdriver.Chrome) -> None:
    """The server's decode of latent frame 3 is held until the page has played past its first frame
    and shows the held call's session and pending latent frames: the playback can only have started
    before the call ended."""
    config = make_config(MODEL, http_port=0, warmup=False)
    release = threading.Event()
    held = threading.Event()
    with serve_in_thread(config, build_engine=held_at_frame_3(config, held, release)) as running:
        try:
            open_page(browser, running.server.http_port)
            set_random_shape(browser, 6, 8, 8)
            browser.find_element(By.ID, "decode").click()
            wait_for(browser, lambda: (s := player(browser))["currentTime"] > 0 and s["framesShown"] >= 2,
                     "the video plays")
            assert not release.is_set()  # latent frame 3 cannot have decoded: the call is not over
            assert player(browser)["doneMs"] is None  # nor has its answer ended
            assert held.wait(WAIT_S)
            load = running.server.pool.device_loads()[0]  # fixed while the decode is held
            assert load.active_sessions == 1
            wait_for(browser, lambda: browser.execute_script(LOAD_CELLS)[:4]
                     == ["cpu", "yes", "1", str(load.pending_latent_frames)], "the page shows the held call's load")
        except BaseException:
            browser.get("about:blank")  # the page's stream closes: the server can stop without waiting on it
            raise
        finally:
            release.set()
        state = played_to_the_end(browser)
        assert state["firstFrameMs"] < state["doneMs"]
        assert state["decodedFrames"] == 1 + SCALE_T * 5 and (state["width"], state["height"]) == (64, 64)
        wait_for(browser, lambda: browser.find_element(By.ID, "sessions-total").text == "0", "the load is back to 0")


# -- status and .pt conversion over plain HTTP -------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    config = make_config(MODEL, http_port=0, auth_token_file=str(token_file), max_message_bytes=1 << 20)
    with serve_in_thread(config) as running:
        yield running


def _url(running: RunningServer, path: str) -> str:
    return f"http://127.0.0.1:{running.server.http_port}{path}"


def test_the_page_and_the_load_need_no_token_and_the_model_does(guarded: RunningServer) -> None:
    for path, kind in (("/", "text/html"), ("/page.js", "text/javascript"), ("/page.css", "text/css")):
        answer = requests.get(_url(guarded, path), timeout=30)
        assert answer.status_code == 200 and answer.headers["Content-Type"].startswith(kind)
        assert "default-src 'self'" in answer.headers["Content-Security-Policy"]
    assert "/page.js" in requests.get(_url(guarded, "/"), timeout=30).text
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status = requests.get(_url(guarded, "/v1/status"), headers=headers, timeout=30).json()
        assert status["status"] == "SERVING" and status["auth_required"] and not status["authorised"]
        assert "model" not in status  # GetModelInfo's facts need the token
        assert [d["device"] for d in status["devices"]] == ["cpu"] and status["devices"][0]["active_sessions"] == 0
    status = requests.get(_url(guarded, "/v1/status"), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()
    assert status["authorised"] and status["model"]["name"] == MODEL
    assert status["model"]["z_dim"] == Z and status["model"]["scale_factor_spatial"] == SCALE_S
    assert status["model"]["default_fps"] == 16 and status["max_sessions"] == 16
    guarded.server.lifecycle.draining = True
    try:
        status = requests.get(_url(guarded, "/v1/status"), headers={"Authorization": f"Bearer {TOKEN}"},
                              timeout=30).json()
        assert status["status"] == "NOT_SERVING" and "draining" in status["error"] and "model" not in status
    finally:
        guarded.server.lifecycle.draining = False


def _pt_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _pt_bytes_legacy(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


def _deflated(pt: bytes, replace: dict[str, bytes] | None = None) -> bytes:
    """A torch.save file's records deflated (as `zipfile` may store them), those whose name ends
    with a key of `replace` replaced by its bytes."""
    plain = zipfile.ZipFile(io.BytesIO(pt))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name in plain.namelist():
            data = next((v for k, v in (replace or {}).items() if name.endswith(k)), None)
            archive.writestr(name, plain.read(name) if data is None else data)
    return out.getvalue()


def _post_watching_load(url: str, data: bytes, auth: dict[str, str]) -> tuple[requests.Response, int]:
    """The answer to `data`, and how many times the in-process server called torch.load."""
    loads = []
    real_load = torch.load
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "load", lambda *args, **kwargs: loads.append(1) or real_load(*args, **kwargs))
        answer = requests.post(url, data=data, headers=auth, timeout=30)
    return answer, len(loads)


def unpacked_before_load(running: RunningServer, url: str, auth: dict[str, str]) -> tuple[int, int]:
    """(status, torch.load calls) of a .pt file whose deflated records hold 2 MiB of zeros (a few
    KB sent, over the fixture's 1 MiB limit once unpacked): refused from its zip directory,
    before torch.load (watched in the in-process server) inflates anything."""
    deflated = _deflated(_pt_bytes(torch.zeros(1, Z, 32, 64, 64)))
    assert len(deflated) < 64 << 10
    answer, loads = _post_watching_load(url, deflated, auth)
    assert re.search(r"the file unpacks to 2\d{6} bytes, over the server's message limit of 1048576 bytes",
                     answer.json()["error"]), answer.text
    return answer.status_code, loads


def pickle_bomb_before_load(url: str, auth: dict[str, str]) -> tuple[int, int, str]:
    """(status, torch.load calls, error) of a .pt file whose pickle is 0.9 MB of one-byte "empty
    dict" opcodes in a list (deflated, a few KB sent): each would build a dict in torch.load
    (20 MB of them took 1.6 GB and 29 s of the server's CPU), refused from its zip directory."""
    # PROTO 2, EMPTY_LIST, MARK, EMPTY_DICT * 900k, APPENDS, STOP
    bomb = _deflated(_pt_bytes(torch.zeros(1)), {"data.pkl": b"\x80\x02](" + b"}" * 900_000 + b"e."})
    assert len(bomb) < 16 << 10
    answer, loads = _post_watching_load(url, bomb, auth)
    return answer.status_code, loads, answer.json()["error"]


def test_a_load_whose_client_left_still_holds_the_one_conversion(guarded: RunningServer,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One .pt file is read at a time: while a load runs (held here), another file is 429 even
    after the first client disconnected (its handler is cancelled, its torch.load in a thread is
    not; the lock had gone with the handler); once that load ends the route reads files again."""
    from vaed.http import page

    started, release = threading.Event(), threading.Event()
    load = page._load_pt

    def held_load(body: Any, limit: int) -> torch.Tensor:
        started.set()
        assert release.wait(WAIT_S)
        return load(body, limit)

    monkeypatch.setattr(page, "_load_pt", held_load)
    url = _url(guarded, "/v1/convert/pt")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    x = torch.randn(1, Z, 2, 4, 6, generator=torch.Generator().manual_seed(4))
    data = _pt_bytes(x)
    head = (f"POST /v1/convert/pt HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    try:
        with socket.create_connection(("127.0.0.1", guarded.server.http_port), timeout=30) as leaving:
            leaving.sendall(head + data)
            assert started.wait(WAIT_S)
        # the first client is gone; for a while (its cancellation comes at once), every file is refused
        for _ in range(20):
            busy = requests.post(url, data=data, headers=auth, timeout=30)
            assert busy.status_code == 429, busy.text
            threading.Event().wait(0.05)
    finally:
        release.set()
    for _ in range(600):  # a bound on a hang: the held load ends, then the lock is free
        answer = requests.post(url, data=data, headers=auth, timeout=30)
        if answer.status_code != 429:
            break
        threading.Event().wait(0.05)
    assert answer.status_code == 200, answer.text


def test_convert_pt(guarded: RunningServer) -> None:
    """A .pt file's tensor comes back as its raw bytes with shape and dtype headers; refusals are
    401 / 411 / 413 from the head (the body unread) and 400 with a JSON error for a bad file."""
    url = _url(guarded, "/v1/convert/pt")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    x = torch.randn(1, Z, 2, 4, 6, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    front = guarded.server.front
    assert front is not None
    before = front.bodies_read
    refused = requests.post(url, data=_pt_bytes(x), timeout=30)
    assert refused.status_code == 401 and "missing credentials" in refused.json()["error"]
    too_big = requests.post(url, data=b"\0" * ((1 << 20) + 1), headers=auth, timeout=30)
    assert too_big.status_code == 413 and "at most 1048576 bytes (its message limit)" in too_big.json()["error"]
    chunked = requests.post(url, data=iter([_pt_bytes(x)]), headers=auth, timeout=30)
    assert chunked.status_code == 411
    assert front.bodies_read == before
    for obj in (x, {"latents": x, "step": 3}, [x], x[0]):
        answer = requests.post(url, data=_pt_bytes(obj), headers=auth, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.headers["shape"] == "[1, 4, 2, 4, 6]" and answer.headers["dtype"] == "bfloat16"
        back = torch.frombuffer(bytearray(answer.content), dtype=torch.bfloat16).reshape(1, Z, 2, 4, 6)
        assert torch.equal(back, x)
    # a tensor whose file is small and whose copy would not be: refused before the copy is made
    expanded = torch.zeros(1, 1, 1, 1, 1).expand(1, Z, 64, 64, 64)
    answer = requests.post(url, data=_pt_bytes(expanded), headers=auth, timeout=30)
    assert answer.status_code == 413, answer.text
    assert "over the server's message limit of 1048576 bytes" in answer.json()["error"], answer.text
    answer = requests.post(url, data=_pt_bytes(x.double()), headers=auth, timeout=30)
    assert answer.headers["dtype"] == "float32"
    assert torch.equal(torch.frombuffer(bytearray(answer.content), dtype=torch.float32).reshape(x.shape),
                       x.double().float())
    assert unpacked_before_load(guarded, url, auth) == (413, 0)
    status, loads, error = pickle_bomb_before_load(url, auth)
    assert (status, loads) == (413, 0) and "the file's pickle is 900006 bytes" in error, error
    for data, pattern in [
        (b"not a zip", "torch.load"),
        (_pt_bytes_legacy(x), "zip format"),
        (_pt_bytes(torch.zeros(3, 3)), r"shape \[3, 3\]"),
        (_pt_bytes(torch.zeros(1, 4, 2, 4, 6, dtype=torch.int32)), "torch.int32"),
        (_pt_bytes({"a": x, "b": x}), "2 tensors"),
        (_pt_bytes(torch.zeros(1, 4, 2, 4, 6).to_sparse()), "torch.sparse_coo"),
        (_pt_bytes(threading.Event), "weights_only"),  # a class: refused by the weights-only unpickler
    ]:
        answer = requests.post(url, data=data, headers=auth, timeout=30)
        assert answer.status_code == 400 and re.search(pattern, answer.json()["error"]), (pattern, answer.text)
        assert "Traceback" not in answer.text
    assert requests.get(_url(guarded, "/health"), timeout=30).status_code == 200


def test_the_page_asks_for_the_token_and_decodes_with_it(browser: webdriver.Chrome, guarded: RunningServer) -> None:
    """Against a server with a token the page shows the load but not the model until the token is
    entered; with it, the status, the decode and its video come through."""
    browser.get(_url(guarded, "/"))
    try:
        wait_for(browser, lambda: "requires a bearer token" in browser.find_element(By.ID, "status-error").text,
                 "the page asks for the token")
        assert browser.find_element(By.ID, "model-name").text == "–"
        assert browser.execute_script(LOAD_CELLS)[:3] == ["cpu", "yes", "0"]  # the load needs no token
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        wait_for(browser, lambda: MODEL in browser.find_element(By.ID, "model-name").text, "the model, with the token")
        assert browser.find_element(By.ID, "status-error").text == ""
        set_random_shape(browser, 2, 4, 6)
        browser.find_element(By.ID, "decode").click()
        state = played_to_the_end(browser)
        assert (state["width"], state["height"]) == (6 * SCALE_S, 4 * SCALE_S) and state["decodedFrames"] == 5
    finally:
        browser.execute_script("sessionStorage.clear()")  # the next page load starts without a token


def test_the_page_decodes_wan22_at_its_own_scale_and_rate(browser: webdriver.Chrome) -> None:
    """The page takes z, the scale factors and the frame rate from /v1/status: Wan2.2 decodes x16
    pixels (2x2 patches on its x8 VAE) at 24 fps."""
    with serve_in_thread(make_config("random:wan2.2-tiny", http_port=0)) as running:
        status = requests.get(_url(running, "/v1/status"), timeout=30).json()["model"]
        browser.get(_url(running, "/"))
        try:
            wait_for(browser, lambda: "wan2.2-tiny" in browser.find_element(By.ID, "model-name").text, "the model")
            set_random_shape(browser, 3, 4, 4)
            browser.find_element(By.ID, "decode").click()
            state = played_to_the_end(browser)
        except BaseException:
            browser.get("about:blank")
            raise
        scale = status["scale_factor_spatial"]
        assert scale == 16 and status["default_fps"] == 24
        assert (state["width"], state["height"]) == (4 * scale, 4 * scale)
        assert state["decodedFrames"] == 1 + status["scale_factor_temporal"] * 2
        with av.open(io.BytesIO(page_mp4(browser))) as container:
            assert container.streams.video[0].average_rate == 24
        assert browser.execute_script("return window.vaedPage.input.shape")[1] == status["z_dim"]


def test_a_stalled_pt_upload_is_cut_and_frees_the_converter() -> None:
    """A client that sends part of its .pt file and stalls is answered 504 after the server's
    --session-first-message-timeout, as a stalled decode body is, and the converter takes the
    next file (it stayed held, every other file refused 429, until the client closed its socket)."""
    x = torch.randn(1, Z, 2, 4, 6, generator=torch.Generator().manual_seed(5))
    data = _pt_bytes(x)
    with serve_in_thread(make_config(MODEL, http_port=0, session_first_message_timeout=1.0)) as running:
        url = _url(running, "/v1/convert/pt")
        head = (f"POST /v1/convert/pt HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", running.server.http_port), timeout=30) as stalled:
            stalled.sendall(head + data[:2])
            answer = b""
            while b"first-message-timeout" not in answer and (chunk := stalled.recv(65536)):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 504") and b"did not arrive within 1 s" in answer, answer
        done = requests.post(url, data=data, timeout=30)
        assert done.status_code == 200, done.text


def test_a_page_that_fails_mid_answer_ends_its_call(browser: webdriver.Chrome) -> None:
    """The page fails on the stream (here its codec parser, made to throw) while the server decodes:
    it aborts its request, so the call ends CANCELLED instead of decoding on for nobody and holding
    its session slot; the next decode from the page then plays."""
    port = _free_port()
    config = make_config(MODEL, http_port=port, metrics_port=port, warmup=False)
    release = threading.Event()
    with serve_in_thread(config, build_engine=held_at_frame_3(config, threading.Event(), release)):
        try:
            open_page(browser, port)
            browser.execute_script("window.mimeOfInit = () => { throw new Error('a parser that fails'); };")
            set_random_shape(browser, 6, 8, 8)
            browser.find_element(By.ID, "decode").click()
            WebDriverWait(browser, WAIT_S, poll_frequency=0.05).until(lambda _: player(browser)["state"] == "error")
            assert player(browser)["error"] == "a parser that fails"
        finally:
            release.set()

        def ended() -> str | None:
            scrape = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            return next((line for line in scrape.splitlines()
                         if line.startswith('vaed_requests_total{') and 'method="Decode"' in line), None)

        line = WebDriverWait(browser, WAIT_S, poll_frequency=0.1).until(lambda _: ended())
        assert line.startswith('vaed_requests_total{code="CANCELLED",method="Decode"} 1.0'), line
        browser.get(f"http://127.0.0.1:{port}/")  # a fresh page, its parser its own again
        open_page(browser, port)
        set_random_shape(browser, 2, 8, 8)
        browser.find_element(By.ID, "decode").click()
        assert played_to_the_end(browser)["decodedFrames"] == 1 + SCALE_T


def test_a_stream_cut_by_the_servers_stop_is_said_to_be_so(browser: webdriver.Chrome) -> None:
    """The server stops (its drain grace ends) while the page reads a decode held at latent frame
    3: the page says the connection closed mid-answer and after how many bytes, where it showed
    the browser's "network error" alone."""
    config = make_config(MODEL, http_port=0, warmup=False)
    release, held = threading.Event(), threading.Event()
    with serve_in_thread(config, build_engine=held_at_frame_3(config, held, release)) as running:
        try:
            open_page(browser, running.server.http_port)
            set_random_shape(browser, 6, 8, 8)
            browser.find_element(By.ID, "decode").click()
            assert held.wait(WAIT_S)
            wait_for(browser, lambda: player(browser)["bytes"] > 0, "the answer's first bytes")
            stopping = asyncio.run_coroutine_threadsafe(running.server.stop(grace=0.2), running.loop)
            WebDriverWait(browser, WAIT_S, poll_frequency=0.05).until(lambda _: player(browser)["state"] == "error")
            error = player(browser)["error"]
            assert re.match(r"the connection closed after \d+ bytes of the answer, before its end \(.+\): "
                            r"the server stopped, restarted or cut the call; see its log$", error), error
            assert f"after {player(browser)['bytes']} bytes" in error
        finally:
            release.set()
        stopping.result(WAIT_S)
    browser.get("about:blank")


def test_a_browser_that_cannot_play_the_stream_still_saves_it(browser: webdriver.Chrome, served: int) -> None:
    """Media Source Extensions without H.264 (some builds): the page says so, reads the stream to
    its end and offers the whole mp4; a second decode's stats are its own (the first's frame
    callbacks had timed frames from the old click)."""
    t, h, w = 2, 8, 8
    open_page(browser, served)
    set_random_shape(browser, t, h, w)
    browser.find_element(By.ID, "decode").click()
    played_to_the_end(browser)
    threading.Event().wait(2)  # the first decode's frame callbacks would time from its click, 2 s older
    clicked = browser.execute_script("return performance.now()")
    browser.find_element(By.ID, "decode").click()
    second = played_to_the_end(browser)
    since_click = browser.execute_script("return performance.now()") - clicked
    assert second["firstFrameMs"] is not None and 0 < second["firstFrameMs"] <= since_click, (second, since_click)
    browser.execute_script("MediaSource.isTypeSupported = () => false;")
    browser.find_element(By.ID, "decode").click()
    wait_for(browser, lambda: player(browser)["state"] == "done", "the stream read to its end")
    assert "cannot play the stream; save the mp4" in browser.find_element(By.ID, "state").text
    assert browser.find_element(By.ID, "download").is_displayed()
    assert frames_of_mp4(page_mp4(browser)).shape == (1 + SCALE_T * (t - 1), h * SCALE_S, w * SCALE_S, 3)
    browser.get("about:blank")  # the patched MediaSource goes with the page


def test_a_narrow_window_keeps_the_controls_in_view(browser: webdriver.Chrome, served: int) -> None:
    """A phone-wide window: one column, the decode button within the page's width."""
    browser.set_window_size(420, 900)
    try:
        open_page(browser, served)
        width = browser.execute_script("return document.documentElement.clientWidth")
        overflow = browser.execute_script("return document.documentElement.scrollWidth")
        button = browser.find_element(By.ID, "decode").rect
        assert overflow <= width and button["x"] + button["width"] <= width, (overflow, width, button)
    finally:
        browser.set_window_size(1200, 1000)

// vaed's page: the served model, its live load, and a player that decodes latents through the
// streaming fMP4 route (POST /decode?output_type=mp4&stream=true) and plays the video through
// Media Source Extensions while it decodes. Plain script, no build step, no outside resources.
//
// window.vaedPage holds the player's state (what the stats show), for people at the console and
// for the browser test.
"use strict";

const STATUS_PATH = "/v1/status";
const CONVERT_PT_PATH = "/v1/convert/pt";
const DECODE_PATH = "/decode";
const STATUS_EVERY_MS = 1000;

const $ = (id) => document.getElementById(id);
let model = null;  // /v1/status's "model" once known
let messageLimit = null;  // /v1/status's "max_message_bytes": the largest body the server takes

const page = {
  state: "idle",       // idle | reading | decoding | done | error
  error: null,
  input: null,         // {shape, dtype, source}
  expected: null,      // {frames, width, height}: what the decode must give
  mime: null,          // the MediaSource type, from the init segment
  firstByteMs: null,   // from the click to the first bytes of the answer
  firstFrameMs: null,  // from the click to the first frame on screen
  doneMs: null,        // from the click to the end of the answer
  bytes: 0,
  framesShown: 0,
  playing: true,       // false where the browser's Media Source Extensions cannot play the stream
  mp4: null,           // the whole answer, once done (a Blob)
  run: 0,              // which decode the stats are of: a newer one stops an older one
};
window.vaedPage = page;

// -- the token ------------------------------------------------------------------------------

// A header carries visible ASCII only: fetch refuses anything else with a TypeError of its own.
function tokenProblem() {
  const token = $("token").value.trim();
  return token && !/^[\x21-\x7e]+$/.test(token) ? "the token holds characters a bearer token cannot carry" : null;
}

function authHeaders() {
  const token = $("token").value.trim();
  if (tokenProblem()) throw new Error(tokenProblem());
  return token ? { Authorization: `Bearer ${token}` } : {};
}

// -- status: model and load -----------------------------------------------------------------

function mib(bytes) {
  return `${(bytes / 1048576).toFixed(1)} MiB`;
}

function showStatus(status) {
  const badge = $("serving");
  badge.textContent = status.status;
  badge.className = "badge " + (status.status === "SERVING" ? "serving" : "not-serving");
  const problems = [];
  if (status.error) problems.push(status.error);
  if (status.auth_required && !status.authorised) {
    problems.push($("token").value.trim() ? "the token entered is not this server's"
      : "this server requires a bearer token: enter it above to see the model and to decode");
  }
  $("status-error").hidden = problems.length === 0;
  $("status-error").textContent = problems.join("\n");
  model = status.model || null;
  messageLimit = status.max_message_bytes || null;
  const m = model;
  $("model-name").textContent = m ? m.name + (m.random_weights ? " (random weights)" : "") : "–";
  $("model-device").textContent = m ? m.devices.join(", ") : "–";
  $("model-dtype").textContent = m ? m.compute_dtype : "–";
  $("model-kernels").textContent = m ? m.kernels : "–";
  $("model-parallel").textContent = m ? m.parallel : "–";
  $("model-latents").textContent = m
    ? `z ${m.z_dim}, x${m.scale_factor_temporal} frames, x${m.scale_factor_spatial} pixels, ${m.default_fps} fps`
    : "–";
  const rows = status.devices.map((d) => {
    const tr = document.createElement("tr");
    const gpu = d.device.startsWith("cuda")
      ? `${mib(d.gpu_memory_allocated_bytes)} (${mib(d.gpu_memory_peak_bytes)})` : "–";
    for (const text of [d.device, d.healthy ? "yes" : "no", d.active_sessions, d.pending_latent_frames, gpu]) {
      const td = document.createElement("td");
      td.textContent = String(text);
      tr.appendChild(td);
    }
    return tr;
  });
  $("load").tBodies[0].replaceChildren(...rows);
  $("sessions-total").textContent = status.devices.reduce((n, d) => n + d.active_sessions, 0);
  $("sessions-max").textContent = status.max_sessions;
}

async function pollStatus() {
  const problem = tokenProblem();
  try {
    const headers = problem ? {} : authHeaders();  // the load needs no token: read it without one
    const response = await fetch(STATUS_PATH, { headers, cache: "no-store" });
    const status = await response.json();
    showStatus(status);
    if (problem) {
      $("status-error").hidden = false;
      $("status-error").textContent = problem;
    }
  } catch (err) {
    $("serving").textContent = "unreachable";
    $("serving").className = "badge not-serving";
    // what the last answer said is no longer so
    $("load").tBodies[0].replaceChildren();
    for (const id of ["sessions-total", "sessions-max"]) setText(id, "–");
    $("status-error").hidden = true;
  }
  setTimeout(pollStatus, STATUS_EVERY_MS);
}

// -- latents: random, .npy, .safetensors, .pt -------------------------------------------------

function mulberry32(seed) {  // a small seeded PRNG: the same seed gives the same latents
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function randomLatents(shape, seed) {
  const random = mulberry32(seed);
  const values = new Float32Array(shape.reduce((a, b) => a * b, 1));
  for (let i = 0; i < values.length; i += 2) {  // Box-Muller: two normal samples per pair
    const r = Math.sqrt(-2 * Math.log(1 - random()));
    const theta = 2 * Math.PI * random();
    values[i] = r * Math.cos(theta);
    if (i + 1 < values.length) values[i + 1] = r * Math.sin(theta);
  }
  return { shape, dtype: "float32", bytes: values.buffer };
}

function toFloat32(buffer) {  // float64 (numpy's default) -> float32, the widest latent dtype
  return new Float32Array(new Float64Array(buffer)).buffer;
}

function parseNpy(buffer) {
  const bytes = new Uint8Array(buffer);
  const magic = String.fromCharCode(...bytes.subarray(1, 6));
  if (bytes[0] !== 0x93 || magic !== "NUMPY") throw new Error("not a .npy file (no \\x93NUMPY magic)");
  const view = new DataView(buffer);
  const major = bytes[6];
  const headerLength = major === 1 ? view.getUint16(8, true) : view.getUint32(8, true);
  const start = major === 1 ? 10 : 12;
  const header = new TextDecoder("latin1").decode(bytes.subarray(start, start + headerLength));
  const descr = /'descr':\s*'([^']+)'/.exec(header);
  const fortran = /'fortran_order':\s*(True|False)/.exec(header);
  const shape = /'shape':\s*\(([^)]*)\)/.exec(header);
  if (!descr || !fortran || !shape) throw new Error(`unreadable .npy header: ${header}`);
  if (fortran[1] === "True") throw new Error(".npy in Fortran order: save a C-order array (np.ascontiguousarray)");
  const dims = shape[1].split(",").map((s) => s.trim()).filter((s) => s).map(Number);
  const data = buffer.slice(start + headerLength);
  const dtypes = { "<f4": "float32", "<f2": "float16", "<f8": "float64" };
  const dtype = dtypes[descr[1]];
  if (!dtype) throw new Error(`.npy dtype ${descr[1]}: latents are little-endian float16 / float32 / float64`);
  const size = { float16: 2, float32: 4, float64: 8 }[dtype];
  if (data.byteLength !== dims.reduce((a, b) => a * b, 1) * size) {
    throw new Error(`.npy of shape (${dims}) holds ${data.byteLength} bytes of ${dtype} (a truncated file?)`);
  }
  return dtype === "float64" ? { shape: dims, dtype: "float32", bytes: toFloat32(data) }
    : { shape: dims, dtype, bytes: data };
}

function parseSafetensors(buffer) {
  if (buffer.byteLength < 8) throw new Error("not a .safetensors file (shorter than its header's length)");
  const view = new DataView(buffer);
  const headerLength = Number(view.getBigUint64(0, true));
  if (headerLength > buffer.byteLength - 8) throw new Error("not a .safetensors file (header past the end)");
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 8, headerLength)));
  const names = Object.keys(header).filter((k) => k !== "__metadata__");
  const name = names.includes("latents") ? "latents" : names.length === 1 ? names[0] : null;
  if (name === null) {
    throw new Error(`the file holds ${names.length} tensors (${names.join(", ")}); keep one, or name it "latents"`);
  }
  const entry = header[name];
  const dtypes = { F32: "float32", F16: "float16", BF16: "bfloat16", F64: "float64" };
  const dtype = dtypes[entry.dtype];
  if (!dtype) throw new Error(`tensor ${name} is ${entry.dtype}: latents are F16 / BF16 / F32 / F64`);
  const [begin, end] = entry.data_offsets;
  if (!(begin <= end && 8 + headerLength + end <= buffer.byteLength)) {
    throw new Error(`tensor ${name}'s bytes end past the file's (a truncated .safetensors?)`);
  }
  const data = buffer.slice(8 + headerLength + begin, 8 + headerLength + end);
  return dtype === "float64" ? { shape: entry.shape, dtype: "float32", bytes: toFloat32(data) }
    : { shape: entry.shape, dtype, bytes: data };
}

async function convertPt(buffer) {  // torch.save's zip + pickle: read by the server's torch.load
  const response = await fetch(CONVERT_PT_PATH, { method: "POST", body: buffer, headers: authHeaders() });
  if (!response.ok) throw new Error(await errorOf(response));
  return {
    shape: JSON.parse(response.headers.get("shape")),
    dtype: response.headers.get("dtype"),
    bytes: await response.arrayBuffer(),
  };
}

async function fileLatents(file) {
  if (messageLimit !== null && file.size > messageLimit) {
    throw new Error(`${file.name} is ${file.size} bytes and this server takes at most ${messageLimit} bytes`);
  }
  const buffer = await file.arrayBuffer();
  const name = file.name.toLowerCase();
  if (name.endsWith(".npy")) return parseNpy(buffer);
  if (name.endsWith(".safetensors")) return parseSafetensors(buffer);
  if (name.endsWith(".pt") || name.endsWith(".pth")) return convertPt(buffer);
  throw new Error(`${file.name}: upload a .npy, .safetensors or .pt file`);
}

function asVideoLatents(latents) {  // [z, T, h, w] is one video
  const shape = latents.shape.length === 4 ? [1, ...latents.shape] : latents.shape;
  if (shape.length !== 5 || shape[0] !== 1) {
    throw new Error(`latents of shape [${latents.shape}]: the player takes one video [1, z, T, h, w]`);
  }
  return { ...latents, shape };
}

// -- fMP4: the codec string from the init segment --------------------------------------------

const CONTAINERS = new Set(["moov", "trak", "mdia", "minf", "stbl"]);

function* boxes(bytes, begin, end) {  // [type, contentStart, boxEnd] of the boxes in bytes[begin, end)
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  let at = begin;
  while (at + 8 <= end) {
    let size = view.getUint32(at);
    const type = String.fromCharCode(...bytes.subarray(at + 4, at + 8));
    let header = 8;
    if (size === 1) {
      if (at + 16 > end) return;
      size = Number(view.getBigUint64(at + 8));
      header = 16;
    } else if (size === 0) {
      size = end - at;
    }
    if (size < header || at + size > end) return;  // not all here yet
    yield [type, at + header, at + size];
    at += size;
  }
}

// The end of the init segment (ftyp + moov) in `bytes`, or -1 while moov is incomplete.
function initSegmentEnd(bytes) {
  for (const [type, , end] of boxes(bytes, 0, bytes.length)) {
    if (type === "moov") return end;
  }
  return -1;
}

// 'video/mp4; codecs="avc1.PPCCLL"' from the sample entry's avcC box (profile, constraints, level).
function mimeOfInit(bytes) {
  const find = (begin, end) => {
    for (const [type, start, stop] of boxes(bytes, begin, end)) {
      if (CONTAINERS.has(type)) {
        const found = find(start, stop);
        if (found) return found;
      } else if (type === "stsd") {  // full box (4 bytes) + entry count (4), then the sample entries
        for (const [entry, entryStart, entryStop] of boxes(bytes, start + 8, stop)) {
          // a visual sample entry's fields take 78 bytes before its own boxes (ISO 14496-12 12.1.3)
          for (const [child, childStart] of boxes(bytes, entryStart + 78, entryStop)) {
            if (child === "avcC") {
              const hex = [...bytes.subarray(childStart + 1, childStart + 4)]
                .map((b) => b.toString(16).padStart(2, "0")).join("");
              return `video/mp4; codecs="${entry}.${hex}"`;
            }
          }
        }
      }
    }
    return null;
  };
  const mime = find(0, bytes.length);
  if (!mime) throw new Error("the stream's init segment has no avcC box (not H.264?)");
  return mime;
}

// -- the player ------------------------------------------------------------------------------

async function errorOf(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${body.error}`;
  } catch (err) {
    return `${response.status} ${response.statusText}`;
  }
}

function setText(id, text) {
  $(id).textContent = text;
}

function showError(message) {
  page.state = "error";
  page.error = message;
  setText("state", "error");
  $("player-error").hidden = false;
  $("player-error").textContent = message;
}

// Appends buffers to a SourceBuffer one at a time (appendBuffer refuses while `updating`).
class Appender {
  constructor(sourceBuffer) {
    this.sourceBuffer = sourceBuffer;
    this.idle = Promise.resolve();
  }

  append(data) {
    const buffer = this.sourceBuffer;
    this.idle = this.idle.then(() => new Promise((resolve, reject) => {
      const settle = (event) => {
        buffer.removeEventListener("updateend", settle);
        buffer.removeEventListener("error", settle);
        if (event.type === "error") reject(new Error("the browser could not append the video"));
        else resolve();
      };
      buffer.addEventListener("updateend", settle);
      buffer.addEventListener("error", settle);
      buffer.appendBuffer(data);
    }));
    return this.idle;
  }
}

function canPlay(mime) {
  return Boolean(window.MediaSource) && MediaSource.isTypeSupported(mime);
}

function openMediaSource(video, mime) {  // for a type the browser can play (canPlay)
  const mediaSource = new MediaSource();
  video.src = objectUrl(mediaSource);
  return new Promise((resolve) => {
    mediaSource.addEventListener("sourceopen", () => resolve([mediaSource, mediaSource.addSourceBuffer(mime)]),
      { once: true });
  });
}

function watchFrames(video, started, run) {
  const onFrame = (now, metadata) => {
    if (run !== page.run) return;  // a later decode's frames: its own callback counts them
    if (page.firstFrameMs === null) {
      page.firstFrameMs = now - started;
      setText("first-frame", `${page.firstFrameMs.toFixed(0)} ms`);
    }
    page.framesShown = metadata.presentedFrames;
    setText("frames-shown", String(page.framesShown));
    video.requestVideoFrameCallback(onFrame);
  };
  video.requestVideoFrameCallback(onFrame);
}

function decodeUrl(latents) {
  const params = new URLSearchParams();
  for (const d of latents.shape) params.append("shape", String(d));
  params.set("dtype", latents.dtype);
  params.set("output_type", "mp4");
  params.set("stream", "true");
  params.set("do_scaling", $("do-scaling").checked ? "true" : "false");
  if ($("fps").value) params.set("fps", $("fps").value);
  if ($("crf").value) params.set("crf", $("crf").value);
  return `${DECODE_PATH}?${params}`;
}

async function readLatents() {
  const source = document.querySelector("input[name=source]:checked").value;
  if (source === "file") {
    const file = $("file").files[0];
    if (!file) throw new Error("choose a file first");
    return { ...asVideoLatents(await fileLatents(file)), source: file.name };
  }
  if (!model) throw new Error("the model is not known yet (see the status above)");
  const shape = [1, model.z_dim, Number($("lat-t").value), Number($("lat-h").value), Number($("lat-w").value)];
  if (!shape.every((d) => Number.isInteger(d) && d >= 1)) throw new Error("T, h and w must be whole numbers from 1");
  return { ...randomLatents(shape, Number($("seed").value)), source: `random, seed ${$("seed").value}` };
}

// The object URLs of the last decode (its MediaSource, its mp4): released by the next one, or the
// browser keeps every decoded video in memory.
let objectUrls = [];

function objectUrl(object) {
  const url = URL.createObjectURL(object);
  objectUrls.push(url);
  return url;
}

async function decodeAndPlay() {
  const run = page.run + 1;
  Object.assign(page, { state: "reading", error: null, input: null, expected: null, mime: null, firstByteMs: null,
    firstFrameMs: null, doneMs: null, bytes: 0, framesShown: 0, playing: true, mp4: null, run });
  for (const id of ["codec", "first-byte", "first-frame", "done", "bytes", "frames-shown", "input-desc",
    "output-desc"]) {
    setText(id, "–");
  }
  $("player-error").hidden = true;
  $("download").hidden = true;
  setText("state", "reading latents");
  const video = $("video");
  video.removeAttribute("src");
  video.load();
  for (const url of objectUrls) URL.revokeObjectURL(url);
  objectUrls = [];
  const started = performance.now();
  const latents = await readLatents();
  page.input = { shape: latents.shape, dtype: latents.dtype, source: latents.source };
  setText("input-desc", `[${latents.shape}] ${latents.dtype} (${latents.source})`);
  if (model) {
    const [, , t, h, w] = latents.shape;
    page.expected = { frames: 1 + model.scale_factor_temporal * (t - 1),
      width: w * model.scale_factor_spatial, height: h * model.scale_factor_spatial };
    setText("output-desc", `${page.expected.frames} frames of ${page.expected.width}x${page.expected.height}`);
  }
  page.state = "decoding";
  setText("state", "decoding");
  // aborted when the page fails mid-answer: the server then ends the call and frees its session
  const stop = new AbortController();
  try {
    await receive(latents, video, started, run, stop.signal);
  } catch (err) {
    stop.abort();
    throw err;
  }
}

async function receive(latents, video, started, run, signal) {
  let response;
  try {
    response = await fetch(decodeUrl(latents), {
      method: "POST", body: latents.bytes, headers: { "Content-Type": "tensor/binary", ...authHeaders() }, signal,
    });
  } catch (err) {
    // the browser's own words ("Failed to fetch") say nothing of why
    throw new Error(`could not reach the server (${err.message}): it may be down or restarting`);
  }
  if (!response.ok) throw new Error(await errorOf(response));
  const reader = response.body.getReader();
  const parts = [];
  let pending = new Uint8Array(0);  // bytes before the init segment is complete
  let appender = null;
  let mediaSource = null;
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (err) {
      // a stream cut mid-answer reads as "network error" alone
      throw new Error(`the connection closed after ${page.bytes} bytes of the answer, before its end `
        + `(${err.message}): the server stopped, restarted or cut the call; see its log`);
    }
    const { done, value } = chunk;
    if (done) break;
    if (page.firstByteMs === null) {
      page.firstByteMs = performance.now() - started;
      setText("first-byte", `${page.firstByteMs.toFixed(0)} ms`);
    }
    parts.push(value);
    page.bytes += value.length;
    setText("bytes", `${page.bytes} bytes`);
    if (appender === null && page.playing) {
      const joined = new Uint8Array(pending.length + value.length);
      joined.set(pending);
      joined.set(value, pending.length);
      pending = joined;
      if (initSegmentEnd(pending) < 0) continue;
      page.mime = mimeOfInit(pending);
      setText("codec", page.mime);
      if (!canPlay(page.mime)) {
        // no playback here, but the video still comes: the link below saves it once it is whole
        page.playing = false;
        setText("state", `decoding (this browser's Media Source Extensions cannot play ${page.mime}; `
          + "save the mp4 when it is done)");
        pending = null;
        continue;
      }
      let sourceBuffer;
      [mediaSource, sourceBuffer] = await openMediaSource(video, page.mime);
      appender = new Appender(sourceBuffer);
      watchFrames(video, started, run);
      appender.append(pending).then(() => video.play()).catch((err) => showError(String(err)));
      pending = null;
    } else if (appender !== null) {
      appender.append(value).catch((err) => showError(String(err)));
    }
  }
  page.doneMs = performance.now() - started;
  setText("done", `${page.doneMs.toFixed(0)} ms`);
  page.mp4 = new Blob(parts, { type: "video/mp4" });
  $("download").href = objectUrl(page.mp4);
  $("download").hidden = false;
  if (!page.playing) {
    page.state = "done";
    setText("state", "done: this browser cannot play the stream; save the mp4");
    return;
  }
  if (appender === null) throw new Error("the answer ended before its init segment");
  await appender.idle;
  mediaSource.endOfStream();
  if (page.state !== "error") {
    page.state = "done";
    setText("state", "done");
  }
}

document.addEventListener("DOMContentLoaded", () => {
  const token = $("token");
  token.value = sessionStorage.getItem("vaed-token") || "";
  token.addEventListener("change", () => sessionStorage.setItem("vaed-token", token.value.trim()));
  $("decode-form").addEventListener("submit", (event) => {
    event.preventDefault();
    $("decode").disabled = true;
    decodeAndPlay().catch((err) => showError(err.message || String(err)))
      .finally(() => { $("decode").disabled = false; });
  });
  $("file").addEventListener("change", () => { document.querySelector("input[value=file]").checked = true; });
  pollStatus();
});

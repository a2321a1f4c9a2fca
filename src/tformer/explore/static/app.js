// tformer explore: the page. Talks only to its own server (/api/...); draws with <canvas>; no libraries. This file
// holds the state, the requests, the prompt, its tokens and the next-token bars; maps.js the attention maps,
// circuits.js the logit lens, head ablation and patching. Loaded last: main() runs once all three are defined.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { info: null, analysis: null, maps: {}, selected: null, sampleStep: 0, hover: null, last: {},
  ablated: new Set(), analyzed: null, lensChosen: false, cleanEdited: false };

async function api(path, body) {
  const response = await fetch(path, body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  const data = await response.json();
  if (!response.ok) throw new Error(data.error || response.statusText);
  state.last[path] = data;
  return data;
}

// The server computes one request at a time, in no set order, so answers can come back out of order: each view draws
// only the answer to the latest request made for it, and a slow answer to an older one is dropped.
const issued = {};

function ticket(view) {
  // a new request for `view`; the function returned tells whether it is still the latest
  const n = (issued[view] = (issued[view] || 0) + 1);
  return () => issued[view] === n;
}

async function latest(view, work) {
  // `work`'s answer, or null where a later request for `view` was made meanwhile (errors of such a one too)
  const current = ticket(view);
  try {
    const answer = await work;
    return current() ? answer : null;
  } catch (err) {
    if (current()) throw err;
    return null;
  }
}

function visible(text) {
  // whitespace made visible: a middle dot for a space, arrows for tab and newline
  return text.replace(/ /g, "\u00b7").replace(/\t/g, "\u2192").replace(/\n/g, "\u21b5").replace(/\r/g, "\u240d");
}

function numberOrNull(id) {
  const value = $(id).value.trim();
  return value === "" ? null : Number(value);
}

function sampling() {
  return { temperature: Number($("temperature").value), top_k: numberOrNull("top-k"), top_p: numberOrNull("top-p") };
}

function common() {
  const body = { prompt: $("prompt").value };
  if (state.info && state.info.kind === "seq2seq") body.target = $("target").value;
  return body;
}

function scaleFactor() {
  const factor = Number($("scale-factor").value);
  // "off" means no 1/sqrt(d_k) at all: a factor of sqrt(d_k) cancels it
  return $("scale-on").checked ? factor : factor * Math.sqrt(state.info.head_dim);
}

function maskMode() {
  return document.querySelector("input[name=mask]:checked").value;
}

function setStatus(text) { $("status").textContent = text; }
function setError(text) { $("error").textContent = text || ""; }

function renderTokens(tokens, ids) {
  const box = $("tokens");
  box.replaceChildren();
  tokens.forEach((token, i) => {
    const span = document.createElement("span");
    span.className = "token";
    span.textContent = visible(token);
    span.title = `#${i} id ${ids[i]}` + (/<0x[0-9A-F]{2}>/.test(token)
      ? ": bytes of a UTF-8 character that the tokenizer splits over several tokens" : "") +
      (state.info.kind === "lm" ? "; click: the logit lens at this token" : "");
    span.dataset.index = i;
    span.addEventListener("mouseenter", () => { state.hover = i; drawDetail(); });
    span.addEventListener("mouseleave", () => { state.hover = null; drawDetail(); });
    span.addEventListener("click", () => {  // the logit lens at this token
      if (state.info.kind !== "lm") return;
      $("lens-position").value = String(i); state.lensChosen = true; refreshLens();
    });
    box.appendChild(span);
  });
}

function renderBars(next) {
  // each token's bar: the probability after the filters, its outline before them; with heads ablated, a tick at the
  // model's own probability and the change beside the value
  const box = $("bars");
  box.replaceChildren();
  const top = Math.max(...next.map((n) => Math.max(n.prob, n.raw, n.original ?? 0, n.original_raw ?? 0)), 1e-9);
  for (const n of next) {
    const row = document.createElement("div");
    row.className = "bar" + (n.kept ? "" : " dropped");
    row.style.display = "contents";
    const label = document.createElement("div");
    label.className = "bar-label";
    label.textContent = visible(n.token);
    label.title = `id ${n.id}`;
    const track = document.createElement("div");
    track.className = "bar-track";
    const raw = document.createElement("div");
    raw.className = "bar-raw";
    raw.style.width = `${(100 * n.raw) / top}%`;
    const fill = document.createElement("div");
    fill.className = "bar-fill";
    fill.style.width = `${(100 * n.prob) / top}%`;
    track.append(raw, fill);
    const value = document.createElement("div");
    value.className = "bar-value";
    value.textContent = (100 * n.prob).toFixed(1) + "%";
    if (n.original !== undefined) {
      const tick = document.createElement("div");
      tick.className = "bar-original";
      tick.style.left = `${(100 * n.original) / top}%`;
      tick.title = `the model's own: ${(100 * n.original).toFixed(1)}%`;
      track.appendChild(tick);
      const delta = document.createElement("span");
      const d = 100 * (n.prob - n.original);
      delta.className = "bar-delta" + (d > 0.05 ? " up" : d < -0.05 ? " down" : "");
      delta.textContent = ` ${d >= 0 ? "+" : ""}${d.toFixed(1)}`;
      value.appendChild(delta);
    }
    row.append(label, track, value);
    box.appendChild(row);
  }
  box.dataset.ready = String(Date.now());
}

async function loadPositions() {
  const kind = state.info.kinds[0];
  const body = { ...(state.analyzed || common()), layer: Math.floor(state.info.layers[kind] / 2), kind };
  const data = await latest("positions", api("/api/positions", body));
  if (!data) return;
  const note = $("positions-note");
  const canvas = $("positions");
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (!data.scores.length) { note.textContent = `position scheme "${data.scheme}": no offset curve to show`; return; }
  if (data.scheme === "rotary") {
    note.textContent = `RoPE, middle layer, each head's mean q\u00b7R(n-m)k / sqrt(d_k); moving both by 100 ` +
      `changes it by ${data.shift_deviation.toExponential(1)} (it depends on n - m only)`;
  } else if (data.scheme === "sinusoidal") {
    note.textContent = `sinusoidal table: PE[m]\u00b7PE[m+d] / C; from m = 100 instead of 0 it differs by ` +
      `${data.shift_deviation.toExponential(1)} (a shift is a rotation)`;
  } else {
    note.textContent = "learned positions: the mean cosine of rows m and m + d (no rule ties them; as trained)";
  }
  const all = data.scores.flat();
  const lo = Math.min(...all), hi = Math.max(...all);
  const x = (d) => 40 + (d / data.offsets[data.offsets.length - 1]) * (canvas.width - 50);
  const y = (v) => canvas.height - 20 - ((v - lo) / (hi - lo || 1)) * (canvas.height - 30);
  ctx.strokeStyle = "#c7c7cc"; ctx.beginPath(); ctx.moveTo(40, 5); ctx.lineTo(40, canvas.height - 20);
  ctx.lineTo(canvas.width - 5, canvas.height - 20); ctx.stroke();
  ctx.fillStyle = "#6e6e73"; ctx.font = "11px sans-serif";
  ctx.fillText(hi.toFixed(2), 2, 12); ctx.fillText(lo.toFixed(2), 2, canvas.height - 22);
  ctx.fillText("offset 0", 40, canvas.height - 5);
  ctx.fillText(String(data.offsets[data.offsets.length - 1]), canvas.width - 25, canvas.height - 5);
  data.scores.forEach((curve, h) => {
    ctx.strokeStyle = `hsl(${(h * 360) / data.scores.length}, 70%, 45%)`;
    ctx.beginPath();
    curve.forEach((v, i) => (i ? ctx.lineTo(x(data.offsets[i]), y(v)) : ctx.moveTo(x(data.offsets[i]), y(v))));
    ctx.stroke();
  });
  canvas.dataset.ready = String(Date.now());
}

function nextRequest(asked) {
  // the next-token bars of `asked` (the prompt, and a seq2seq model's target): the model's own, or with the ablated
  // heads zeroed beside it
  const body = { ...common(), ...asked, ...sampling() };
  if (!state.ablated.size || state.info.kind !== "lm") return api("/api/analyze", body);
  delete body.target;
  return api("/api/ablate", { ...body, heads: ablatedHeads() });
}

function drawBars(data) {
  state.analysis = data;
  renderBars(data.next);
  ablationNote(data.heads && data.heads.length ? data : null);
}

function isStale() {
  const a = state.analyzed;
  return a !== null && (a.prompt !== $("prompt").value || (a.target || "") !== (common().target || ""));
}

function markStale() {
  // the shown analysis greyed, with a note, while the prompt differs from the one it is of
  const stale = isStale();
  for (const id of ["next-panel", "attention-panel", "lens-panel", "positions-panel"]) {
    $(id).classList.toggle("stale", stale);
  }
  $("stale").hidden = !stale;
}

async function analyze() {
  const current = ticket("analyze");
  setError("");
  setStatus("computing ...");
  const asked = common();
  try {
    const request = api("/api/analyze", { ...asked, ...sampling() });
    const bars = latest("bars", state.ablated.size && state.info.kind === "lm" ? nextRequest(asked) : request);
    const [data, next] = await Promise.all([request, bars]);
    if (!current()) return;  // a later analysis draws everything
    if (next) drawBars(next);  // else a later change of the sampling settings or heads draws the bars
    renderTokens(data.tokens, data.ids);
    if (!state.analyzed || state.analyzed.prompt !== asked.prompt) state.lensChosen = false;  // a new prompt: its last
    state.analyzed = asked;
    if (state.info.kind === "lm") {
      lensPositions(data.tokens);
      if (!state.cleanEdited) $("patch-clean").value = asked.prompt;  // follows the prompt until edited
    }
    markStale();
    await loadMaps();
    await loadLens();
    await loadPositions();
    if (current()) setStatus(`${data.ids.length} tokens`);
  } catch (err) {
    if (!current()) return;
    setStatus("");
    setError(err.message);
  }
}

async function refreshBars() {
  if (!state.analysis) return;
  try {
    const data = await latest("bars", nextRequest(state.analyzed || {}));
    if (!data) return;
    drawBars(data);
    setError("");
  } catch (err) { setError(err.message); }
}

async function refreshMaps() {
  if (!state.analysis) return;
  try { await loadMaps(); setError(""); } catch (err) { setError(err.message); }
}

async function sampleOne() {
  setError("");
  try {
    const body = { ...common(), ...sampling(), seed: Number($("seed").value) + state.sampleStep };
    const data = await api("/api/sample", body);
    state.sampleStep += 1;
    if (state.info.kind === "lm") $("prompt").value = data.prompt;
    else $("target").value = data.target;
    await analyze();
  } catch (err) { setError(err.message); }
}

function download(name, url) {
  const a = document.createElement("a");
  a.href = url; a.download = name;
  document.body.appendChild(a); a.click(); a.remove();
}

function exportPng() {
  download("tformer-attention.png", $("detail").toDataURL("image/png"));
}

function exportJson() {
  const data = { model: state.info, selected: state.selected, prompt: $("prompt").value, sampling: sampling(),
    ablated: ablatedHeads(), lens: state.last["/api/lens"] || null, patch: state.last["/api/patch"] || null,
    scale_factor: scaleFactor(), mask: maskMode(), analysis: state.analysis,
    attention: state.selected ? state.maps[`${state.selected.kind}/${state.selected.layer}`] : null };
  const blob = new Blob([JSON.stringify(data, null, 1)], { type: "application/json" });
  download("tformer-view.json", URL.createObjectURL(blob));
}

async function main() {
  state.info = await api("/api/info");
  const i = state.info;
  $("model-info").textContent = `${i.name}: ${i.kind === "lm" ? "language model" : "encoder-decoder"}, ` +
    `${Object.values(i.layers)[0]} layers, ${i.heads} heads (${i.kv_heads} kv), d_model ${i.d_model}, ` +
    `${i.position} positions, ${i.norm_first ? "Pre-LN" : "Post-LN"}, ${i.dtype}`;
  $("target-row").hidden = i.kind !== "seq2seq";
  $("prompt").value = i.prompt;
  const lm = i.kind === "lm";
  $("lens-panel").hidden = !lm;
  $("patch-panel").hidden = !lm;
  document.querySelector("input[name=click][value=ablate]").disabled = !lm;
  ablationNote(null);
  $("analyze").addEventListener("click", analyze);
  $("sample").addEventListener("click", sampleOne);
  $("temperature").addEventListener("input", () => {
    $("temperature-value").textContent = Number($("temperature").value).toFixed(2);
  });
  for (const id of ["temperature", "top-k", "top-p"]) $(id).addEventListener("change", refreshBars);
  $("scale-factor").addEventListener("input", () => {
    $("scale-value").textContent = Number($("scale-factor").value).toFixed(2);
  });
  for (const id of ["scale-factor", "scale-on"]) $(id).addEventListener("change", refreshMaps);
  document.querySelectorAll("input[name=mask]").forEach((r) => r.addEventListener("change", refreshMaps));
  $("export-png").addEventListener("click", exportPng);
  $("export-json").addEventListener("click", exportJson);
  for (const id of ["prompt", "target"]) {
    $(id).addEventListener("keydown", (e) => {
      // Enter analyzes; Shift+Enter is a new line
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); analyze(); }
    });
    $(id).addEventListener("input", markStale);
  }
  $("restore-heads").addEventListener("click", restoreAll);
  $("lens-position").addEventListener("change", () => { state.lensChosen = true; refreshLens(); });
  $("lens-k").addEventListener("change", refreshLens);
  $("patch-run").addEventListener("click", runPatch);
  $("patch-clean").addEventListener("input", () => { state.cleanEdited = true; });
  await analyze();
}

main().catch((err) => setError(err.message));

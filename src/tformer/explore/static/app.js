// tformer explore: the page. Talks only to its own server (/api/...); draws with <canvas>; no libraries.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { info: null, analysis: null, maps: {}, selected: null, sampleStep: 0, hover: null, last: {} };

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
    span.title = `#${i} id ${ids[i]}`;
    span.dataset.index = i;
    span.addEventListener("mouseenter", () => { state.hover = i; drawDetail(); });
    span.addEventListener("mouseleave", () => { state.hover = null; drawDetail(); });
    box.appendChild(span);
  });
}

function renderBars(next) {
  const box = $("bars");
  box.replaceChildren();
  const top = Math.max(...next.map((n) => Math.max(n.prob, n.raw)), 1e-9);
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
    row.append(label, track, value);
    box.appendChild(row);
  }
  box.dataset.ready = String(Date.now());
}

function heat(value) {
  // 0 -> white, 1 -> dark blue
  const v = Math.max(0, Math.min(1, value));
  return [Math.round(255 - 245 * v), Math.round(255 - 200 * v), Math.round(255 - 90 * v)];
}

function paint(canvas, weights, size) {
  const rows = weights.length, cols = weights[0].length;
  canvas.width = size; canvas.height = size;
  const ctx = canvas.getContext("2d");
  const image = ctx.createImageData(cols, rows);
  let max = 0;
  for (const row of weights) for (const w of row) max = Math.max(max, w);
  for (let i = 0; i < rows; i++) {
    for (let j = 0; j < cols; j++) {
      const [r, g, b] = heat(weights[i][j] / (max || 1));
      const k = 4 * (i * cols + j);
      image.data[k] = r; image.data[k + 1] = g; image.data[k + 2] = b; image.data[k + 3] = 255;
    }
  }
  const tmp = document.createElement("canvas");
  tmp.width = cols; tmp.height = rows;
  tmp.getContext("2d").putImageData(image, 0, 0);
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(tmp, 0, 0, size, size);
}

async function loadMaps() {
  const kinds = state.info.kinds;
  const requests = [];
  for (const kind of kinds) {
    for (let layer = 0; layer < state.info.layers[kind]; layer++) {
      const body = { ...common(), layer, kind, scale_factor: scaleFactor(), mask: maskMode() };
      requests.push(api("/api/attention", body).then((data) => ({ kind, layer, data })));
    }
  }
  const results = await latest("maps", Promise.all(requests));
  if (!results) return;  // a later request draws the maps
  const grids = $("grids");
  grids.replaceChildren();
  state.maps = {};
  const gridOf = {};
  for (const kind of kinds) {
    const grid = document.createElement("div");
    grid.className = "grid";
    grid.style.gridTemplateColumns = `auto repeat(${state.info.heads}, auto)`;
    const title = document.createElement("div");
    title.className = "grid-title";
    title.style.gridColumn = `1 / span ${state.info.heads + 1}`;
    title.textContent = { self: "self-attention", encoder: "encoder self-attention",
      decoder: "decoder self-attention (causal)", cross: "cross-attention (decoder -> encoder)" }[kind];
    grid.appendChild(title);
    grids.appendChild(grid);
    gridOf[kind] = grid;
  }
  results.sort((a, b) => a.layer - b.layer);
  const size = Math.max(24, Math.min(64, Math.floor(560 / state.info.heads)));
  for (const { kind, layer, data } of results) {
    const grid = gridOf[kind];
    state.maps[`${kind}/${layer}`] = data;
    const label = document.createElement("div");
    label.className = "layer-label";
    label.textContent = `L${layer}`;
    grid.appendChild(label);
    data.weights.forEach((weights, head) => {
      const canvas = document.createElement("canvas");
      canvas.className = "map";
      canvas.title = `${kind} layer ${layer} head ${head}`;
      canvas.dataset.kind = kind; canvas.dataset.layer = layer; canvas.dataset.head = head;
      paint(canvas, weights, size);
      canvas.addEventListener("click", () => { state.selected = { kind, layer, head }; drawDetail(); });
      grid.appendChild(canvas);
    });
  }
  if (!state.selected || !state.maps[`${state.selected.kind}/${state.selected.layer}`]) {
    state.selected = { kind: state.info.kinds[0], layer: 0, head: 0 };
  }
  grids.dataset.ready = String(Date.now());
  drawDetail();
}

function drawDetail() {
  if (!state.selected) return;
  const { kind, layer, head } = state.selected;
  const data = state.maps[`${kind}/${layer}`];
  if (!data) return;
  document.querySelectorAll(".grid canvas").forEach((c) => c.classList.toggle("selected",
    c.dataset.kind === kind && Number(c.dataset.layer) === layer && Number(c.dataset.head) === head));
  const canvas = $("detail");
  const weights = data.weights[head];
  paint(canvas, weights, 520);
  const ctx = canvas.getContext("2d");
  const rows = weights.length, cols = weights[0].length;
  if (state.hover !== null && state.hover < rows && (kind === "self" || kind === "encoder")) {
    ctx.strokeStyle = "#ff9f0a"; ctx.lineWidth = 2;
    ctx.strokeRect(0, (state.hover * 520) / rows, 520, 520 / rows);
  }
  document.querySelectorAll(".token").forEach((t) => t.classList.remove("hot"));
  if (state.hover !== null && state.hover < rows && (kind === "self" || kind === "encoder")) {
    const row = weights[state.hover];
    const best = row.indexOf(Math.max(...row));
    const span = document.querySelector(`.token[data-index="${best}"]`);
    if (span) span.classList.add("hot");
  }
  $("detail-title").textContent = `${kind} layer ${layer}, head ${head}: rows = queries (${rows}), ` +
    `columns = keys (${cols}); scale ${data.scale.toFixed(4)}`;
  const low = Math.min(...data.row_sum_min), high = Math.max(...data.row_sum_max);
  const leak = $("leak");
  const broken = low < 0.999 || high > 1.001;
  leak.className = "leak" + (broken ? " bad" : "");
  leak.textContent = broken
    ? `rows sum to ${low.toFixed(3)} - ${high.toFixed(3)}: masking after the softmax leaks the future's mass`
    : `every row sums to 1 (${low.toFixed(4)} - ${high.toFixed(4)})`;
  const body = document.querySelector("#heads tbody");
  body.replaceChildren();
  data.entropy.forEach((e, h) => {
    const tr = document.createElement("tr");
    for (const cell of [h, e.toFixed(3), data.jacobian_norm[h].toFixed(4),
      `${data.row_sum_min[h].toFixed(3)} - ${data.row_sum_max[h].toFixed(3)}`]) {
      const td = document.createElement("td"); td.textContent = cell; tr.appendChild(td);
    }
    if (h === head) tr.style.fontWeight = "600";
    body.appendChild(tr);
  });
}

async function loadPositions() {
  const kind = state.info.kinds[0];
  const body = { ...common(), layer: Math.floor(state.info.layers[kind] / 2), kind };
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

async function analyze() {
  const current = ticket("analyze");
  setError("");
  setStatus("computing ...");
  try {
    const request = api("/api/analyze", { ...common(), ...sampling() });
    const [data, bars] = await Promise.all([request, latest("bars", request)]);
    if (!current()) return;  // a later analysis draws everything
    if (bars) {  // else a later change of the sampling settings draws the bars
      state.analysis = bars;
      renderBars(bars.next);
    }
    renderTokens(data.tokens, data.ids);
    await loadMaps();
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
    const data = await latest("bars", api("/api/analyze", { ...common(), ...sampling() }));
    if (!data) return;
    state.analysis = data;
    renderBars(data.next);
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
  $("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && e.ctrlKey) analyze(); });
  await analyze();
}

main().catch((err) => setError(err.message));

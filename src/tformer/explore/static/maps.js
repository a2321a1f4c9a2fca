// tformer explore: the attention maps. Small multiples (one per layer and head, each named "L{layer} H{head}"), the
// enlarged map with token labels on both axes and its colour scale, and the clicks on a head: enlarge it, or ablate
// it (circuits.js draws what that does to the next-token bars). Uses app.js's state, $, api, latest and visible.
"use strict";

const DETAIL = { left: 112, top: 8, size: 520, bottom: 104, scale: 96 };  // the enlarged map's layout, in pixels

function heat(value) {
  // 0 -> white, 1 -> dark blue
  const v = Math.max(0, Math.min(1, value));
  return [Math.round(255 - 245 * v), Math.round(255 - 200 * v), Math.round(255 - 90 * v)];
}

function paintAt(ctx, weights, x, y, w, h, colour) {
  // `weights` (rows x cols) as an image at (x, y), w x h pixels, each cell coloured by colour(value)
  const rows = weights.length, cols = weights[0].length;
  const image = ctx.createImageData(cols, rows);
  for (let i = 0; i < rows; i++) {
    for (let j = 0; j < cols; j++) {
      const [r, g, b] = colour(weights[i][j]);
      const k = 4 * (i * cols + j);
      image.data[k] = r; image.data[k + 1] = g; image.data[k + 2] = b; image.data[k + 3] = 255;
    }
  }
  const tmp = document.createElement("canvas");
  tmp.width = cols; tmp.height = rows;
  tmp.getContext("2d").putImageData(image, 0, 0);
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(tmp, x, y, w, h);
}

function maxOf(weights) {
  let max = 0;
  for (const row of weights) for (const w of row) max = Math.max(max, w);
  return max || 1;
}

function paint(canvas, weights, size) {
  canvas.width = size; canvas.height = size;
  const max = maxOf(weights);
  paintAt(canvas.getContext("2d"), weights, 0, 0, size, size, (v) => heat(v / max));
}

function short(token, n = 10) {
  const text = visible(token);
  return text.length > n ? text.slice(0, n - 1) + "\u2026" : text;
}

function axisLabels(ctx, tokens, x, y, length, vertical) {
  // every token's label along one side of a map (every n-th where the cells are under 12 px); the indices drawn
  const cell = length / tokens.length, every = Math.max(1, Math.ceil(12 / cell)), drawn = [];
  ctx.fillStyle = "#3a3a3c"; ctx.font = "11px ui-monospace, monospace";
  for (let i = 0; i < tokens.length; i += every) {
    const centre = (i + 0.5) * cell;
    ctx.save();
    if (vertical) {  // query labels, right-aligned left of the map
      ctx.textAlign = "right"; ctx.textBaseline = "middle";
      ctx.fillText(short(tokens[i]), x - 4, y + centre);
    } else {  // key labels, rotated, below the map
      ctx.translate(x + centre, y + 4); ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "right"; ctx.textBaseline = "middle";
      ctx.fillText(short(tokens[i]), 0, 0);
    }
    ctx.restore();
    drawn.push(i);
  }
  return drawn;
}

function colourScale(ctx, x, y, height, colour, ticks) {
  // a vertical bar from colour(1) at the top to colour(0) at the bottom; ticks: [[fraction 0..1, text], ...]
  for (let i = 0; i < height; i++) {
    const [r, g, b] = colour(1 - i / (height - 1));
    ctx.fillStyle = `rgb(${r},${g},${b})`;
    ctx.fillRect(x, y + i, 14, 1);
  }
  ctx.strokeStyle = "#8e8e93"; ctx.strokeRect(x + 0.5, y + 0.5, 14, height - 1);
  ctx.fillStyle = "#3a3a3c"; ctx.font = "11px sans-serif"; ctx.textAlign = "left"; ctx.textBaseline = "middle";
  for (const [f, text] of ticks) ctx.fillText(text, x + 19, y + (1 - f) * (height - 1));
}

function headKey(layer, head) { return `${layer}/${head}`; }

function onMapClick(event, kind, layer, head) {
  const ablate = event.shiftKey || document.querySelector("input[name=click]:checked").value === "ablate";
  if (ablate && state.info.kind === "lm") toggleHead(layer, head);  // circuits.js
  else { state.selected = { kind, layer, head }; drawDetail(); }
}

function markAblated() {
  document.querySelectorAll(".grid .head").forEach((box) => {
    const off = box.dataset.kind === "self" && state.ablated.has(headKey(box.dataset.layer, box.dataset.head));
    box.classList.toggle("ablated", off);
    box.querySelector(".head-label").textContent = `L${box.dataset.layer} H${box.dataset.head}${off ? " off" : ""}`;
  });
}

async function loadMaps() {
  const kinds = state.info.kinds;
  const requests = [];
  for (const kind of kinds) {
    for (let layer = 0; layer < state.info.layers[kind]; layer++) {
      const body = { ...(state.analyzed || common()), layer, kind, scale_factor: scaleFactor(), mask: maskMode() };
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
      const box = document.createElement("div");
      box.className = "head";
      box.dataset.kind = kind; box.dataset.layer = layer; box.dataset.head = head;
      const canvas = document.createElement("canvas");
      canvas.className = "map";
      canvas.title = `${kind} layer ${layer} head ${head}: click to enlarge` +
        (state.info.kind === "lm" ? "; shift-click (or the ablate switch) to ablate it" : "");
      canvas.dataset.kind = kind; canvas.dataset.layer = layer; canvas.dataset.head = head;
      paint(canvas, weights, size);
      canvas.addEventListener("click", (event) => onMapClick(event, kind, layer, head));
      const name = document.createElement("div");
      name.className = "head-label";
      box.append(canvas, name);
      grid.appendChild(box);
    });
  }
  if (!state.selected || !state.maps[`${state.selected.kind}/${state.selected.layer}`]) {
    state.selected = { kind: state.info.kinds[0], layer: 0, head: 0 };
  }
  markAblated();
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
  const { left, top, size, bottom, scale } = DETAIL;
  canvas.width = left + size + scale; canvas.height = top + size + bottom;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#ffffff"; ctx.fillRect(0, 0, canvas.width, canvas.height);
  const max = maxOf(weights);
  paintAt(ctx, weights, left, top, size, size, (v) => heat(v / max));
  const rows = weights.length, cols = weights[0].length;
  const drawn = { queries: axisLabels(ctx, data.queries, left, top, size, true),
    keys: axisLabels(ctx, data.keys, left, top + size, size, false) };
  ctx.fillStyle = "#6e6e73"; ctx.font = "11px sans-serif"; ctx.textAlign = "center";
  ctx.fillText("keys (attended to) \u2192", left + size / 2, canvas.height - 6);
  colourScale(ctx, left + size + 12, top, size, heat, [[1, max.toFixed(3)], [0.5, (max / 2).toFixed(3)], [0, "0"]]);
  canvas.dataset.labels = JSON.stringify({ queries: drawn.queries.map((i) => data.queries[i]),
    keys: drawn.keys.map((i) => data.keys[i]) });
  canvas.dataset.scale = `0 - ${max.toFixed(3)}`;
  const self = kind === "self" || kind === "encoder";
  if (state.hover !== null && state.hover < rows && self) {
    ctx.strokeStyle = "#ff9f0a"; ctx.lineWidth = 2;
    ctx.strokeRect(left, top + (state.hover * size) / rows, size, size / rows);
  }
  document.querySelectorAll(".token").forEach((t) => t.classList.remove("hot"));
  if (state.hover !== null && state.hover < rows && self) {
    const row = weights[state.hover];
    const best = row.indexOf(Math.max(...row));
    const span = document.querySelector(`.token[data-index="${best}"]`);
    if (span) span.classList.add("hot");
  }
  $("detail-title").textContent = `${kind} layer ${layer}, head ${head}: rows = queries (${rows}), ` +
    `columns = keys (${cols}); scale ${data.scale.toFixed(4)}; colour: attention weight, 0 to this head's ` +
    `largest (${max.toFixed(3)})`;
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
    for (const cell of [`L${layer} H${h}`, e.toFixed(3), data.jacobian_norm[h].toFixed(4),
      `${data.row_sum_min[h].toFixed(3)} - ${data.row_sum_max[h].toFixed(3)}`]) {
      const td = document.createElement("td"); td.textContent = cell; tr.appendChild(td);
    }
    tr.children[1].title = ENTROPY_TIP; tr.children[2].title = JACOBIAN_TIP;
    if (h === head) tr.style.fontWeight = "600";
    body.appendChild(tr);
  });
}

const ENTROPY_TIP = "entropy of the head's attention row, averaged over queries, in nats: 0 = all weight on one " +
  "key, ln(keys) = spread evenly";
const JACOBIAN_TIP = "Frobenius norm of the softmax's Jacobian d weights / d scores, averaged over rows: how much " +
  "the weights (and the gradient) respond to the scores; near 0 = saturated";

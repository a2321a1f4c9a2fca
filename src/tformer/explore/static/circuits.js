// tformer explore: the circuit views. The logit lens (the top tokens at one position, layer by layer), head ablation
// (the next-token bars with the clicked heads zeroed beside the model's own) and activation patching (the restored
// logit difference as a layer x position heat map). Uses app.js's state, $, api, latest, visible and maps.js's
// drawing helpers.
"use strict";

// -- head ablation -------------------------------------------------------------------------------------------------

function toggleHead(layer, head) {
  const key = headKey(layer, head);
  if (state.ablated.has(key)) state.ablated.delete(key); else state.ablated.add(key);
  markAblated();
  refreshBars();
}

function ablatedHeads() {
  return [...state.ablated].map((k) => k.split("/").map(Number)).sort((a, b) => a[0] - b[0] || a[1] - b[1]);
}

function ablationNote(data) {
  const note = $("ablation-note");
  const restore = $("restore-heads");
  restore.hidden = !data;
  if (!data) {
    note.textContent = state.info && state.info.kind === "lm"
      ? "Shift-click a head's map (or switch clicks to ablate) to zero it and see the bars change." : "";
    return;
  }
  const names = data.heads.map(([l, h]) => `L${l} H${h}`).join(", ");
  note.textContent = `ablated (zero): ${names}. Bars: the ablated model; the black tick: the model's own ` +
    `probability. Total variation between the two: ${data.total_variation.toFixed(4)}.`;
}

function restoreAll() {
  state.ablated.clear();
  markAblated();
  refreshBars();
}

// -- the logit lens ------------------------------------------------------------------------------------------------

function lensPositions(tokens) {
  // the position chooser: one option per token, the last by default (or the one chosen before, if still there)
  const select = $("lens-position");
  const before = select.value === "" ? null : Number(select.value);
  select.replaceChildren();
  tokens.forEach((token, i) => {
    const option = document.createElement("option");
    option.value = String(i);
    option.textContent = `#${i} ${short(token, 16)}`;
    select.appendChild(option);
  });
  const keep = before !== null && before < tokens.length && state.lensChosen;
  select.value = String(keep ? before : tokens.length - 1);
}

async function loadLens() {
  if (state.info.kind !== "lm") return;
  const position = Number($("lens-position").value), k = Number($("lens-k").value);
  const body = { prompt: state.analyzed.prompt, position, k };
  const data = await latest("lens", api("/api/lens", body));
  if (!data) return;
  const table = $("lens");
  table.replaceChildren();
  const head = document.createElement("tr");
  for (const text of ["layer", ...data.rows[0].top.map((_, i) => `#${i + 1}`), `p(${visible(data.final.token)})`]) {
    const th = document.createElement("th"); th.textContent = text; head.appendChild(th);
  }
  head.lastChild.title = "each row's probability of the model's own top token (the last row's first)";
  table.appendChild(head);
  for (const row of data.rows) {
    const tr = document.createElement("tr");
    const label = document.createElement("th");
    label.textContent = row.label;
    label.title = row.label === "embed" ? "the embeddings alone, through the final norm and the output head"
      : `the residual stream leaving block ${row.label.slice(1)}`;
    tr.appendChild(label);
    for (const t of row.top) {
      const td = document.createElement("td");
      td.className = "lens-cell";
      const [r, g, b] = heat(t.prob);
      td.style.background = `rgb(${r},${g},${b})`;
      if (t.prob > 0.55) td.style.color = "#ffffff";
      td.textContent = `${visible(t.token)} ${(100 * t.prob).toFixed(1)}%`;
      td.title = `id ${t.id}`;
      tr.appendChild(td);
    }
    const final = document.createElement("td");
    final.textContent = `${(100 * row.final_prob).toFixed(1)}%`;
    tr.appendChild(final);
    table.appendChild(tr);
  }
  $("lens-note").textContent = `position #${data.position}, token "${visible(data.token)}": what each layer's ` +
    "residual stream predicts for the next token, read through the final norm and the output head; the last row " +
    "is the model's own distribution" + (state.ablated.size ? " (with every head: ablation shows in the bars)." : ".");
  table.dataset.ready = String(Date.now());
}

async function refreshLens() {
  if (!state.analyzed) return;
  try { await loadLens(); setError(""); } catch (err) { setError(err.message); }
}

// -- activation patching -------------------------------------------------------------------------------------------

function diverging(value) {
  // -1 -> red, 0 -> white, 1 -> blue (clipped)
  const v = Math.max(-1, Math.min(1, value));
  return v >= 0 ? heat(v) : [Math.round(255 - 40 * -v), Math.round(255 - 215 * -v), Math.round(255 - 215 * -v)];
}

function drawPatch(data) {
  const canvas = $("patch-map");
  const values = data.restored || data.patched;
  const layers = values.length, T = values[0].length;
  const left = 56, top = 8, cell = Math.max(12, Math.min(40, Math.floor(640 / T))), bottom = 104, right = 110;
  canvas.width = left + cell * T + right; canvas.height = top + cell * layers + bottom;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#ffffff"; ctx.fillRect(0, 0, canvas.width, canvas.height);
  const spread = data.restored ? 1 : Math.max(1e-9, ...values.flat().map(Math.abs));
  paintAt(ctx, values, left, top, cell * T, cell * layers, (v) => diverging(v / spread));
  const columns = data.clean_tokens.map((t, i) => {  // a position where the prompts differ: "clean->corrupted"
    const other = data.corrupted_tokens[i];
    return t === other ? t : `${t}\u2192${other}`;
  });
  axisLabels(ctx, data.layers, left, top, cell * layers, true);
  axisLabels(ctx, columns, left, top + cell * layers, cell * T, false);
  const ticks = data.restored ? [[1, "1 (restored)"], [0.5, "0"], [0, "-1"]]
    : [[1, spread.toFixed(2)], [0.5, "0"], [0, (-spread).toFixed(2)]];
  colourScale(ctx, left + cell * T + 12, top, Math.max(60, cell * layers), (f) => diverging(2 * f - 1), ticks);
  canvas.dataset.shape = `${layers}x${T}`;
  canvas.dataset.ready = String(Date.now());
}

async function runPatch() {
  const error = $("patch-error");
  error.textContent = "";
  const body = { clean: $("patch-clean").value, corrupted: $("patch-corrupted").value };
  for (const name of ["correct", "wrong"]) {
    const value = $(`patch-${name}`).value;
    if (value !== "") body[name] = value;
  }
  $("patch-status").textContent = "patching ...";
  try {
    const data = await latest("patch", api("/api/patch", body));
    if (!data) return;
    $("patch-status").textContent = "";
    drawPatch(data);
    const what = `logit difference ${visible(data.correct.token)} - ${visible(data.wrong.token)}: clean ` +
      `${data.clean_diff.toFixed(3)}, corrupted ${data.corrupted_diff.toFixed(3)}.`;
    $("patch-note").textContent = data.restored
      ? `${what} Colour: the share of that gap restored by putting the clean residual stream back at one layer ` +
        "(entering it) and position; 1 = all of it (clipped to -1 .. 1)."
      : `${what} The two runs give the same difference: nothing to restore; the map shows the raw difference.`;
  } catch (err) {
    $("patch-status").textContent = "";
    error.textContent = err.message;
  }
}

// The routing demo's page: reads the controls, asks the server's JSON endpoint (api/route) for the batches,
// and draws what it answers. Nothing here routes or balances: every number shown comes from k3 on the server.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const form = document.getElementById("controls");
const nextButton = document.getElementById("next");
const errorBox = document.getElementById("error");
const state = { batches: 1, maxBatches: 200, sent: 0, result: null };

function el(name, attrs, text) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function clearSvg(svg) {
  for (const child of [...svg.children]) if (child.tagName !== "desc") child.remove();
}

function query() {
  const data = new FormData(form);
  const params = new URLSearchParams();
  for (const name of ["tokens", "experts", "k", "skew", "seed", "rule"]) params.set(name, data.get(name));
  if (data.get("rule") === "fixed") params.set("step", data.get("step"));
  if (data.get("rule") === "quantile") params.set("cutoff", data.get("cutoff"));
  params.set("batches", String(state.batches));
  return params;
}

function syncRuleInputs() {
  const rule = new FormData(form).get("rule");
  form.elements.step.disabled = rule !== "fixed";
  form.elements.cutoff.disabled = rule !== "quantile";
}

function showError(message, param) {
  for (const input of form.querySelectorAll("[aria-invalid]")) input.removeAttribute("aria-invalid");
  if (message === null) {
    errorBox.hidden = true;
    errorBox.textContent = "";
    return;
  }
  errorBox.textContent = message;
  errorBox.hidden = false;
  const field = param && form.elements[param];
  if (field && field.setAttribute) field.setAttribute("aria-invalid", "true");
}

async function update() {
  const ticket = ++state.sent; // answers to superseded requests are dropped
  document.body.setAttribute("aria-busy", "true");
  let response, body;
  try {
    response = await fetch("api/route?" + query().toString(), { headers: { Accept: "application/json" } });
    body = await response.json();
  } catch (err) {
    if (ticket === state.sent) {
      showError("The demo server did not answer (" + err.message + "). Is `k3 demo routing` still running?", null);
      document.body.removeAttribute("aria-busy");
    }
    return;
  }
  if (ticket !== state.sent) return;
  document.body.removeAttribute("aria-busy");
  if (!response.ok) {
    const error = body.error || { message: "HTTP " + response.status };
    showError(error.message, error.param);
    if (error.param === "batches" && state.batches > 1) state.batches -= 1; // the step that broke a limit is undone
    return;
  }
  showError(null);
  state.result = body;
  render(body);
}

function fmt(x, digits) {
  return Number(x).toFixed(digits);
}

function render(result) {
  const batches = result.batches;
  const last = batches[batches.length - 1];
  const n = batches.length;
  document.getElementById("batch-no").textContent = String(n);
  const p = result.params;
  const over = last.loads.filter((load) => load > result.target_load).length;
  document.getElementById("summary").textContent =
    `batch ${n}: MaxVio ${fmt(last.maxvio, 3)} · target q = ${fmt(result.target_load, 2)} tokens · ` +
    `${over} of ${p.experts} experts above q · largest load ${Math.max(...last.loads)}`;
  drawBars(last, result.target_load);
  drawMaxVio(batches);
  fillTables(last, batches);
  nextButton.disabled = n >= state.maxBatches;
  document.body.dataset.batches = String(n); // what is drawn, for a test or a script driving the page
  document.body.dataset.rule = p.rule;
}

function drawBars(batch, q) {
  const svg = document.getElementById("bars");
  clearSvg(svg);
  const W = 640, H = 280, left = 44, right = 10, top = 14, bottom = 34;
  const plotW = W - left - right, plotH = H - top - bottom;
  const E = batch.loads.length;
  const yMax = Math.max(q, ...batch.loads) * 1.1 || 1;
  const y = (v) => top + plotH * (1 - v / yMax);
  const slot = plotW / E;
  const gap = E <= 64 ? Math.min(4, slot * 0.2) : 0;
  for (const frac of [0, 0.5, 1]) {
    const v = Math.round(yMax * frac);
    svg.append(el("line", { class: "axis", x1: left, x2: W - right, y1: y(v), y2: y(v) }));
    svg.append(el("text", { x: left - 6, y: y(v) + 4, "text-anchor": "end" }, String(v)));
  }
  const labelEvery = Math.ceil(E / 16);
  batch.loads.forEach((load, e) => {
    const x = left + e * slot + gap / 2;
    const rect = el("rect", {
      class: "bar " + (load > q ? "over" : "under"),
      x: x, y: y(load), width: Math.max(slot - gap, 0.5), height: Math.max(y(0) - y(load), 0),
      "data-expert": e, "data-load": load,
    });
    rect.append(el("title", {}, `expert ${e}: ${load} tokens, bias ${fmt(batch.bias[e], 4)}`));
    svg.append(rect);
    if (e % labelEvery === 0) {
      svg.append(el("text", { x: x + (slot - gap) / 2, y: H - bottom + 16, "text-anchor": "middle" }, String(e)));
    }
  });
  svg.append(el("text", { x: left + plotW / 2, y: H - 4, "text-anchor": "middle" }, "expert"));
  svg.append(el("line", { class: "target", x1: left, x2: W - right, y1: y(q), y2: y(q), "data-q": q }));
  svg.append(el("text", { class: "target-label", x: W - right - 4, y: y(q) - 5, "text-anchor": "end" },
    `q = ${fmt(q, q % 1 ? 2 : 0)}`));
  document.getElementById("bars-desc").textContent =
    `Bar chart of tokens per expert for ${E} experts; the dashed line marks the target load q = ${fmt(q, 2)}. ` +
    `Loads: ${batch.loads.join(", ")}.`;
}

function drawMaxVio(batches) {
  const svg = document.getElementById("maxvio-chart");
  clearSvg(svg);
  const W = 640, H = 180, left = 44, right = 14, top = 12, bottom = 30;
  const plotW = W - left - right, plotH = H - top - bottom;
  const values = batches.map((b) => b.maxvio);
  const yMax = Math.max(...values, 0.1) * 1.1;
  const span = Math.max(values.length - 1, 1);
  const x = (i) => left + (values.length === 1 ? plotW / 2 : (plotW * i) / span);
  const y = (v) => top + plotH * (1 - v / yMax);
  for (const v of [0, yMax / 2, yMax]) {
    svg.append(el("line", { class: "axis", x1: left, x2: W - right, y1: y(v), y2: y(v) }));
    svg.append(el("text", { x: left - 6, y: y(v) + 4, "text-anchor": "end" }, fmt(v, v >= 10 ? 0 : 1)));
  }
  svg.append(el("text", { x: left + plotW / 2, y: H - 4, "text-anchor": "middle" }, "batch"));
  svg.append(el("text", { x: left, y: H - bottom + 16, "text-anchor": "start" }, "1"));
  if (values.length > 1) {
    svg.append(el("text", { x: W - right, y: H - bottom + 16, "text-anchor": "end" }, String(values.length)));
  }
  svg.append(el("polyline", { class: "curve", points: values.map((v, i) => `${x(i)},${y(v)}`).join(" ") }));
  const radius = values.length > 60 ? 2 : 3.5;
  values.forEach((v, i) => {
    const dot = el("circle", {
      class: "pt" + (i === values.length - 1 ? " current" : ""), cx: x(i), cy: y(v), r: radius, "data-maxvio": v,
    });
    dot.append(el("title", {}, `batch ${i + 1}: MaxVio ${fmt(v, 3)}`));
    svg.append(dot);
  });
  document.getElementById("maxvio-desc").textContent =
    `Line chart of MaxVio for batches 1 to ${values.length}: ${values.map((v) => fmt(v, 3)).join(", ")}.`;
}

function fillTables(batch, batches) {
  const rows = batch.loads.map((load, e) => `<tr><td>${e}</td><td>${load}</td><td>${fmt(batch.bias[e], 4)}</td></tr>`);
  document.querySelector("#experts-table tbody").innerHTML = rows.join("");
  const vio = batches.map((b, i) => `<tr><td>${i + 1}</td><td>${fmt(b.maxvio, 3)}</td></tr>`);
  document.querySelector("#maxvio-table tbody").innerHTML = vio.join("");
}

function restart() {
  state.batches = 1;
  syncRuleInputs();
  update();
}

let typing = null;
form.addEventListener("change", () => {
  clearTimeout(typing);
  restart();
});
form.addEventListener("input", (event) => {
  if (event.target.type !== "number") return;
  clearTimeout(typing);
  typing = setTimeout(restart, 400); // after a pause in typing; `change` answers at once on Enter or leaving
});
form.addEventListener("submit", (event) => {
  event.preventDefault();
  restart();
});
nextButton.addEventListener("click", () => {
  if (state.batches >= state.maxBatches) return;
  state.batches += 1;
  update();
});
document.getElementById("reset").addEventListener("click", restart);
document.addEventListener("keydown", (event) => {
  const inField = event.target.closest && event.target.closest("input, select, textarea");
  if (event.key === "n" && !inField && !event.ctrlKey && !event.metaKey && !event.altKey) nextButton.click();
});

async function start() {
  try {
    const limits = await (await fetch("api/limits")).json();
    state.maxBatches = limits.max_batches;
    for (const [name, max] of [["tokens", limits.max_tokens], ["experts", limits.max_experts],
      ["k", limits.max_experts], ["skew", limits.max_skew], ["step", limits.max_step]]) {
      form.elements[name].max = String(max);
    }
  } catch (err) {
    // the limits only annotate the inputs; the server checks every request anyway
  }
  restart();
}

start();

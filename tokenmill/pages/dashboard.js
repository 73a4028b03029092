// tokenmill's live dashboard: polls GET /v1/stats and draws its figures on canvases.
// A server of many models (tokenmill serve with no model) has a figure set per loaded model:
// the models GET /api/ps lists fill a select, and the chosen one (?model= in the address) is
// asked for as /v1/stats?model=NAME. No libraries. The API key (asked for when the stats route answers 401) stays in this tab's
// sessionStorage and goes out as "Authorization: Bearer <key>".
"use strict";

const KEY_STORAGE = "tokenmill.apiKey";
const params = new URLSearchParams(location.search);
const POLL_MS = Math.max(200, Number(params.get("interval_ms")) || 1000);
const MAX_POINTS = 180;
const MODELS_EVERY = 5;  // polls between two looks at which models are loaded
const COLORS = ["#4cc2ff", "#ffb347", "#5fd38d", "#ff6b6b", "#c38dff"];

// Each chart: its title, unit, and the series read from one stats object.
const CHARTS = [
  { id: "requests", title: "Requests", unit: "", series: [
    ["running", (s) => s.num_requests_running],
    ["waiting", (s) => s.num_requests_waiting]] },
  { id: "cache", title: "KV cache usage and prefix-cache hit rate", unit: "%", max: 100, series: [
    ["KV cache", (s) => 100 * s.kv_cache_usage],
    ["prefix hits", (s) => pct(s.prefix_cache_hit_rate)]] },
  { id: "throughput", title: "Tokens per second", unit: "tok/s", series: [
    ["generation", (s) => s.generation_tokens_per_s],
    ["prompt", (s) => s.prompt_tokens_per_s]] },
  { id: "ttft", title: "Time to first token", unit: "ms", series: [
    ["p50", (s) => ms(s.ttft_s.p50)], ["p90", (s) => ms(s.ttft_s.p90)],
    ["p99", (s) => ms(s.ttft_s.p99)]] },
  { id: "itl", title: "Inter-token latency", unit: "ms", series: [
    ["p50", (s) => ms(s.itl_s.p50)], ["p90", (s) => ms(s.itl_s.p90)],
    ["p99", (s) => ms(s.itl_s.p99)]] },
  { id: "preemptions", title: "Preemptions in the window", unit: "", series: [
    ["preemptions", (s) => s.window_preemptions]] },
  { id: "spec", title: "Speculative decoding: accepted draft tokens", unit: "%", max: 100,
    series: [["acceptance", (s) => pct(s.spec_acceptance_rate)]] },
  { id: "cost", title: "Cost per million tokens", unit: "USD", series: [
    ["billed prices", (s) => s.usd_per_million_tokens_billed],
    ["per hour, output", (s) => s.usd_per_million_output_tokens],
    ["per hour, total", (s) => s.usd_per_million_total_tokens]] },
];

const TILES = [
  ["running", (s) => s.num_requests_running],
  ["waiting", (s) => s.num_requests_waiting],
  ["KV cache", (s) => fmt(100 * s.kv_cache_usage, "%")],
  ["prefix hits", (s) => fmt(pct(s.prefix_cache_hit_rate), "%")],
  ["generation tok/s", (s) => fmt(s.generation_tokens_per_s)],
  ["prompt tok/s", (s) => fmt(s.prompt_tokens_per_s)],
  ["TTFT p50", (s) => fmt(ms(s.ttft_s.p50), " ms")],
  ["ITL p50", (s) => fmt(ms(s.itl_s.p50), " ms")],
  ["preemptions", (s) => s.num_preemptions],
  ["spec acceptance", (s) => fmt(pct(s.spec_acceptance_rate), "%")],
  ["USD / M tokens", (s) => fmt(s.usd_per_million_tokens_billed ??
                                s.usd_per_million_total_tokens, "", 4)],
];

function emptyHistory() { return CHARTS.map((c) => c.series.map(() => [])); }
function pct(x) { return x == null ? null : 100 * x; }
function ms(x) { return x == null ? null : 1000 * x; }
function fmt(x, unit = "", digits = 1) {
  if (x == null || !isFinite(x)) return "-";
  return (Math.abs(x) >= 100 ? Math.round(x) : x.toFixed(digits)) + unit;
}

const state = { polls: 0, errors: 0, ticks: 0, last: null, model: params.get("model"),
                models: [], history: emptyHistory() };
window.tokenmillDashboard = state;  // for tests and the curious

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text) node.textContent = text;
  return node;
}

function build() {
  const tiles = document.getElementById("tiles");
  for (const [label] of TILES) {
    const tile = el("div", { class: "tile" });
    tile.append(el("div", { class: "label" }, label), el("div", { class: "value" }, "-"));
    tiles.append(tile);
  }
  const charts = document.getElementById("charts");
  for (const chart of CHARTS) {
    const box = el("div", { class: "chart" });
    box.append(el("h2", {}, chart.title + (chart.unit ? ` (${chart.unit})` : "")));
    box.append(el("canvas", { id: `chart-${chart.id}`, "data-points": "0" }));
    charts.append(box);
  }
}

function draw(chart, history) {
  const canvas = document.getElementById(`chart-${chart.id}`);
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr)) canvas.width = Math.round(w * dpr);
  if (canvas.height !== Math.round(h * dpr)) canvas.height = Math.round(h * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const left = 48, right = 8, top = 18, bottom = 16;
  const values = history.flat().filter((v) => v != null && isFinite(v));
  // An axis up to the largest value (rounded up), or to 1 while every value is 0.
  const topValue = Math.max(0, ...values);
  const max = chart.max ?? (topValue > 0 ? niceCeil(topValue) : 1);
  // Grid and y labels.
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#8a96a3";
  ctx.strokeStyle = "#2a3440";
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = top + (h - top - bottom) * (1 - i / 4);
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(w - right, y); ctx.stroke();
    ctx.fillText(fmt((max * i) / 4, "", max < 4 ? 2 : 1), 4, y + 4);
  }
  ctx.fillText(`last ${Math.round((MAX_POINTS * POLL_MS) / 1000)} s`, left, h - 3);
  // Series, newest point at the right edge.
  const xStep = (w - left - right) / (MAX_POINTS - 1);
  let legendX = left;
  history.forEach((points, i) => {
    const color = COLORS[i % COLORS.length];
    ctx.strokeStyle = color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    let pen = false;
    points.forEach((v, j) => {
      if (v == null || !isFinite(v)) { pen = false; return; }
      const x = left + (MAX_POINTS - points.length + j) * xStep;
      const y = top + (h - top - bottom) * (1 - Math.min(v, max) / max);
      if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      pen = true;
    });
    ctx.stroke();
    const last = points.length ? points[points.length - 1] : null;
    const label = `${chart.series[i][0]} ${fmt(last)}`;
    ctx.fillStyle = color;
    ctx.fillRect(legendX, 5, 8, 8);
    ctx.fillText(label, legendX + 11, 13);
    legendX += ctx.measureText(label).width + 24;
  });
  canvas.dataset.points = String(history[0].length);
  canvas.dataset.max = String(values.length ? Math.max(...values) : 0);
}

function niceCeil(x) {
  const p = Math.pow(10, Math.floor(Math.log10(x)));
  for (const m of [1, 2, 5, 10]) if (m * p >= x) return m * p;
  return 10 * p;
}

function render(stats) {
  document.getElementById("model").textContent = stats.model;
  const status = document.getElementById("status");
  status.textContent = stats.status;
  status.className = stats.status === "ready" ? "ok" : "bad";
  document.getElementById("uptime").textContent = `${Math.round(stats.uptime_s)} s`;
  document.getElementById("window").textContent = `${stats.window_s} s`;
  document.getElementById("updated").textContent = new Date(stats.time * 1000).toLocaleTimeString();
  document.querySelectorAll("#tiles .value").forEach((node, i) => {
    node.textContent = TILES[i][1](stats);
  });
  CHARTS.forEach((chart, c) => {
    chart.series.forEach(([, read], i) => {
      const points = state.history[c][i];
      points.push(read(stats));
      if (points.length > MAX_POINTS) points.shift();
    });
    draw(chart, state.history[c]);
  });
}

function askForKey(message) {
  document.getElementById("main").style.display = "none";
  document.getElementById("key-form").classList.add("shown");
  document.getElementById("key-error").textContent = message;
  document.getElementById("api-key").focus();
}

// The loaded models, into the select (shown when there is a choice).
async function listModels(headers) {
  const response = await fetch("/api/ps", { headers, cache: "no-store" });
  if (!response.ok) return;
  const names = (await response.json()).models.map((m) => m.name.replace(/:latest$/, ""));
  state.models = names;
  const select = document.getElementById("model-select");
  const shown = state.model ?? state.last?.model;
  select.replaceChildren(...names.map((name) => {
    const option = el("option", { value: name }, name);
    option.selected = name === shown;
    return option;
  }));
  select.hidden = names.length < 2;
  document.getElementById("model").hidden = !select.hidden;
}

function chooseModel(name) {
  state.model = name;
  state.history = emptyHistory();
  const address = new URL(location.href);
  address.searchParams.set("model", name);
  history.replaceState(null, "", address);
}

async function poll() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  try {
    if (state.ticks++ % MODELS_EVERY === 0) await listModels(headers);
    const query = state.model ? `?model=${encodeURIComponent(state.model)}` : "";
    const response = await fetch(`/v1/stats${query}`, { headers, cache: "no-store" });
    if (response.status === 404 && state.model) {  // that model was unloaded
      state.model = null;
      state.ticks = 0;  // the models are listed again
      throw new Error("the chosen model is no longer loaded");
    }
    if (response.status === 401) {
      sessionStorage.removeItem(KEY_STORAGE);
      askForKey(key ? "That key was refused." : "");
      return;  // polling resumes when a key is given
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const stats = await response.json();
    state.polls += 1;
    state.last = stats;
    render(stats);
  } catch (error) {
    state.errors += 1;
    document.getElementById("updated").textContent = `stats unavailable: ${error.message}`;
  }
  setTimeout(poll, POLL_MS);
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = document.getElementById("api-key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORAGE, key);
  document.getElementById("key-form").classList.remove("shown");
  document.getElementById("main").style.display = "";
  poll();
});

document.getElementById("model-select").addEventListener("change", (event) => {
  chooseModel(event.target.value);
});

build();
poll();

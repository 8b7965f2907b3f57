// The live page: polls /dashboard/data and draws the fleet's table and charts (uPlot).
"use strict";

const POLL_MS = 2000;
const COLORS = ["#4a7bd0", "#d0794a", "#3a9d5d", "#b8423a", "#8a5cc2", "#c2a23a", "#3aa3b8", "#777"];
const charts = new Map(); // chart id -> {plot, keys}
let polls = 0;

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function tierBar(td, tier) {
  const used = tier.capacity_blocks ? tier.num_blocks / tier.capacity_blocks : 0;
  const label = document.createElement("div");
  label.textContent = `${tier.medium} ${tier.num_blocks}/${tier.capacity_blocks}`;
  const bar = document.createElement("span");
  bar.className = "tier";
  const fill = document.createElement("span");
  fill.style.width = `${Math.min(100, used * 100).toFixed(1)}%`;
  bar.appendChild(fill);
  label.prepend(bar);
  td.appendChild(label);
}

function renderInstances(rows) {
  const body = document.querySelector("#instances tbody");
  body.replaceChildren();
  for (const r of rows) {
    const row = body.insertRow();
    cell(row, r.instance_id);
    cell(row, r.role);
    cell(row, r.draining ? `${r.health}, draining` : r.health, r.health);
    cell(row, r.running, "num");
    cell(row, r.waiting, "num");
    cell(row, r.inflight, "num");
    const tiers = row.insertCell();
    if (r.tiers.length === 0) tiers.textContent = `GPU ${(r.kv_usage * 100).toFixed(1)}%`;
    for (const t of r.tiers) tierBar(tiers, t);
    cell(row, r.prefix_hit_rate === null ? "–" : `${(r.prefix_hit_rate * 100).toFixed(1)}%`, "num");
  }
}

function chartBox(spec) {
  let box = document.getElementById(`chart-${spec.id}`);
  if (!box) {
    box = document.createElement("div");
    box.id = `chart-${spec.id}`;
    box.className = "chart";
    document.getElementById("charts").appendChild(box);
  }
  return box;
}

function renderChart(spec, time) {
  const keys = Object.keys(spec.lines).sort();
  const box = chartBox(spec);
  let chart = charts.get(spec.id);
  if (!chart || chart.keys.join("\n") !== keys.join("\n")) {
    if (chart) chart.plot.destroy();
    box.replaceChildren();
    charts.delete(spec.id);
    if (keys.length === 0) {
      const empty = document.createElement("div");
      empty.className = "empty";
      empty.textContent = `${spec.title}: nothing yet`;
      box.appendChild(empty);
      return;
    }
    const opts = {
      title: `${spec.title} (${spec.unit})`,
      width: 470,
      height: 200,
      scales: { y: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] } },
      series: [{}, ...keys.map((k, i) => ({ label: k, stroke: COLORS[i % COLORS.length], width: 1.5 }))],
    };
    chart = { plot: new uPlot(opts, [time, ...keys.map((k) => spec.lines[k])], box), keys };
    charts.set(spec.id, chart);
    return;
  }
  chart.plot.setData([time, ...keys.map((k) => spec.lines[k])]);
}

function render(data) {
  renderInstances(data.instances);
  const states = Object.entries(data.states).map(([s, n]) => `${s} ${n}`);
  document.getElementById("states").textContent = states.join(" · ");
  for (const spec of data.charts) renderChart(spec, data.time);
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const response = await fetch("/dashboard/data", { credentials: "same-origin" });
    if (!response.ok) throw new Error(`GET /dashboard/data: HTTP ${response.status}`);
    render(await response.json());
    polls += 1;
    status.dataset.polls = String(polls);
    status.textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    status.textContent = `not updated: ${error.message}`;
    console.error(error);
  }
  setTimeout(poll, POLL_MS);
}

poll();

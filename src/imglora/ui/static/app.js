// imglora ui: plain JS over the server's JSON API; the run folders stay the only database.
"use strict";
const $ = (sel) => document.querySelector(sel);
const esc = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
const fmt = (x, d = 3) => (typeof x === "number" ? x.toFixed(d) : "");
const hms = (s) => (typeof s !== "number" ? "" : s < 3600 ? `${Math.floor(s / 60)}m${String(Math.round(s) % 60).padStart(2, "0")}s`
  : `${Math.floor(s / 3600)}h${String(Math.floor(s / 60) % 60).padStart(2, "0")}m`);

async function api(path, options = {}) {
  const r = await fetch(path, {headers: {"content-type": "application/json"}, ...options});
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(body.error || `${r.status} ${r.statusText}`);
  return body;
}

// ------------------------------------------------------------------------------ navigation
function show(page) {
  document.querySelectorAll(".page").forEach((p) => (p.hidden = p.id !== `page-${page}`));
  document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("active", a.dataset.page === page));
}
window.addEventListener("hashchange", () => show(location.hash.slice(1) || "runs"));

// ------------------------------------------------------------------------------ runs
let current = null, source = null, rows = [];

async function loadRuns() {
  const data = await api("/api/runs");
  $("#root").textContent = data.root;
  $("#runs-table tbody").innerHTML = data.runs.map((r) => `
    <tr class="run" data-name="${esc(r.name)}">
      <td>${esc(r.name)}</td><td class="state-${r.state}">${esc(r.state)} ${esc(r.detail)}</td>
      <td>${r.step ?? ""}${r.total ? " / " + r.total : ""}</td><td>${fmt(r.loss, 4)}</td>
      <td>${fmt(r.sec_per_update)}</td><td>${hms(r.eta_seconds)}</td><td>${fmt(r.cost, 2)}</td>
      <td>${fmt(r.projected_cost, 2)}</td><td>${r.peak_allocated ? fmt(r.peak_allocated / 2 ** 30, 2) : ""}</td>
    </tr>`).join("");
  document.querySelectorAll("tr.run").forEach((tr) => tr.addEventListener("click", () => openRun(tr.dataset.name)));
}

function drawCurve() {
  const svg = $("#curve"), W = 720, H = 240, pad = 30;
  const pts = rows.filter((r) => typeof r.loss === "number");
  if (!pts.length) { svg.innerHTML = `<text x="20" y="40">no logged update yet</text>`; return; }
  const steps = pts.map((r) => r.step), losses = pts.map((r) => r.loss);
  const x0 = Math.min(...steps), x1 = Math.max(...steps, x0 + 1), y0 = Math.min(...losses), y1 = Math.max(...losses, y0 + 1e-9);
  const X = (s) => pad + ((s - x0) / (x1 - x0)) * (W - 2 * pad), Y = (l) => H - pad - ((l - y0) / (y1 - y0)) * (H - 2 * pad);
  let m = null;
  const smooth = losses.map((l) => (m = m === null ? l : 0.9 * m + 0.1 * l));
  const line = (vals, cls) => `<polyline class="${cls}" fill="none" stroke="${cls === "raw" ? "#9bd" : "#135"}"
    stroke-width="${cls === "raw" ? 1 : 2}" points="${vals.map((v, i) => `${X(steps[i]).toFixed(1)},${Y(v).toFixed(1)}`).join(" ")}"/>`;
  svg.innerHTML = line(losses, "raw") + line(smooth, "smooth") +
    `<text x="${pad}" y="${H - 8}" font-size="11">update ${x0}</text><text x="${W - pad - 70}" y="${H - 8}" font-size="11">update ${x1}</text>
     <text x="4" y="${pad}" font-size="11">${y1.toFixed(3)}</text><text x="4" y="${H - pad}" font-size="11">${y0.toFixed(3)}</text>`;
  svg.dataset.points = String(pts.length);
}

function showSummary(s) {
  $("#run-state").innerHTML = `<span class="state-${s.state}">${esc(s.state)}</span> ${esc(s.detail)} —
    update ${s.step ?? "–"}${s.total ? " / " + s.total : ""}, loss ${fmt(s.loss, 4)}, ${fmt(s.sec_per_update)} s/update,
    ETA ${hms(s.eta_seconds) || "–"}, cost so far ${fmt(s.cost, 2) || "–"}, projected ${fmt(s.projected_cost, 2) || "–"}`;
  $("#run-state").dataset.state = s.state;
  $("#btn-stop").disabled = s.state !== "running";
  $("#btn-resume").disabled = !s.resumable;
}

async function openRun(name) {
  current = name;
  const d = await api(`/api/runs/${encodeURIComponent(name)}`);
  $("#run-detail").hidden = false;
  $("#run-name").textContent = name;
  rows = d.rows;
  showSummary(d);
  drawCurve();
  $("#tail").textContent = d.tail.join("\n");
  $("#evals tbody").innerHTML = d.evals.map((e) => `<tr><td>${esc(e.started)}</td><td>${esc(e.status)}</td>
    <td>held-out loss ${esc(JSON.stringify(e.held_out_loss))}</td><td>best: ${esc(JSON.stringify(e.best_checkpoint))}</td></tr>`).join("");
  $("#sheets").innerHTML = d.sheets.map((p) => `<figure><img src="/files/${encodeURI(p)}" alt="${esc(p)}"><figcaption>${esc(p)}</figcaption></figure>`).join("");
  const link = $("#adapter-link");
  link.hidden = !d.adapter;
  if (d.adapter) { link.href = `/files/${encodeURI(d.adapter)}`; link.textContent = "download adapter"; }
  if (source) source.close();
  const last = rows.length ? rows[rows.length - 1].step : -1;
  source = new EventSource(`/api/runs/${encodeURIComponent(name)}/events?after=${last}`);
  source.onmessage = (ev) => {
    const msg = JSON.parse(ev.data);
    rows = rows.concat(msg.rows);
    showSummary(msg.summary);
    drawCurve();
    if (msg.tail && msg.tail.length) $("#tail").textContent = msg.tail.join("\n");
  };
}

async function runAction(path, body) {
  try {
    const job = await api(path, {method: "POST", body: JSON.stringify(body || {})});
    $("#job").textContent = `started: imglora ${job.argv ? job.argv.join(" ") : ""}`;
    if (job.id) pollJob(job.id, $("#job"));
    setTimeout(loadRuns, 1500);
  } catch (e) { $("#job").textContent = `error: ${e.message}`; }
}

async function pollJob(id, out) {
  const j = await api(`/api/jobs/${id}`);
  out.textContent = `imglora ${j.argv.join(" ")}: ${j.running ? "running" : "exit " + j.returncode}\n` + j.tail.join("\n");
  out.dataset.done = j.running ? "" : String(j.returncode);
  if (j.running) setTimeout(() => pollJob(id, out), 1000);
}

$("#btn-stop").onclick = () => runAction(`/api/runs/${encodeURIComponent(current)}/stop`);
$("#btn-resume").onclick = () => runAction(`/api/runs/${encodeURIComponent(current)}/resume`);
$("#btn-eval").onclick = () => runAction(`/api/runs/${encodeURIComponent(current)}/eval`);
$("#btn-export").onclick = () => runAction(`/api/runs/${encodeURIComponent(current)}/export`, {comfyui: $("#export-comfyui").value});

// ------------------------------------------------------------------------------ new run
let keys = [];
async function loadNew() {
  const presets = (await api("/api/presets")).presets;
  for (const sel of [$("#preset"), $("#tools-preset")]) sel.innerHTML = presets.map((p) => `<option>${esc(p)}</option>`).join("");
  keys = (await api("/api/schema")).keys;
  renderKeys();
}
function renderKeys() {
  const f = $("#key-filter").value.trim();
  $("#keys tbody").innerHTML = keys.filter((k) => !f || k.key.includes(f)).slice(0, 80).map((k) => `
    <tr><td>${esc(k.key)}</td><td><input data-key="${esc(k.key)}" value="${esc(k.value ?? "")}"></td>
    <td>${esc(k.default)}</td><td>${esc(k.help)}</td></tr>`).join("");
  document.querySelectorAll("#keys input").forEach((i) => i.addEventListener("change", () => {
    keys.find((k) => k.key === i.dataset.key).value = i.value;
  }));
}
$("#key-filter").addEventListener("input", renderKeys);
const overrides = () => keys.filter((k) => k.value !== undefined && k.value !== "").map((k) => `${k.key}=${k.value}`);
const spec = () => ({preset: $("#preset").value, overrides: overrides()});

$("#btn-check").onclick = async () => {
  const r = await api("/api/check", {method: "POST", body: JSON.stringify(spec())});
  $("#problems").textContent = r.ok ? "no problem: the configuration is valid" : r.problems;
  $("#problems").dataset.ok = String(r.ok);
};
$("#btn-plan").onclick = async () => {
  $("#plan").textContent = "planning ...";
  try { $("#plan").textContent = (await api("/api/plan", {method: "POST", body: JSON.stringify({...spec(), gpu: $("#gpu").value})})).text; }
  catch (e) { $("#plan").textContent = e.message; }
};
$("#btn-start").onclick = async () => {
  const check = await api("/api/check", {method: "POST", body: JSON.stringify(spec())});
  if (!check.ok) { $("#problems").textContent = check.problems; $("#problems").dataset.ok = "false"; return; }
  try {
    const r = await api("/api/runs", {method: "POST", body: JSON.stringify(spec())});
    $("#problems").textContent = `started ${r.run}`;
    location.hash = "runs";
    await loadRuns();
    openRun(r.run);
  } catch (e) { $("#problems").textContent = e.message; }
};

// ------------------------------------------------------------------------------ dataset
$("#btn-dataset").onclick = async () => {
  try {
    const d = await api(`/api/dataset?dir=${encodeURIComponent($("#dataset-dir").value)}`);
    $("#dataset-warnings").innerHTML = d.warnings.map((w) => `<li>${esc(w)}</li>`).join("");
    $("#gallery").innerHTML = d.items.map((it) => `<div class="item"><img src="/files/${encodeURI(it.image)}" alt="">
      <div>${esc(it.image)}</div><textarea data-image="${esc(it.image)}">${esc(it.caption)}</textarea>
      ${it.warnings.map((w) => `<div class="warn">${esc(w)}</div>`).join("")}<span class="saved"></span></div>`).join("");
    document.querySelectorAll("#gallery textarea").forEach((t) => t.addEventListener("change", async () => {
      const r = await api("/api/caption", {method: "PUT", body: JSON.stringify({image: t.dataset.image, caption: t.value})});
      t.nextElementSibling && (t.parentElement.querySelector(".saved").textContent = "saved");
      t.value = r.caption;
    }));
  } catch (e) { $("#dataset-warnings").innerHTML = `<li>${esc(e.message)}</li>`; }
};

// ------------------------------------------------------------------------------ tools
const tool = (path, body) => async () => {
  try { const j = await api(path, {method: "POST", body: JSON.stringify(body())}); pollJob(j.id, $("#tools-out")); }
  catch (e) { $("#tools-out").textContent = e.message; }
};
$("#btn-doctor").onclick = tool("/api/doctor", () => ({preset: $("#tools-preset").value}));
$("#btn-fetch-dry").onclick = tool("/api/fetch", () => ({preset: $("#tools-preset").value, dry_run: true}));
$("#btn-fetch").onclick = tool("/api/fetch", () => ({preset: $("#tools-preset").value}));

show(location.hash.slice(1) || "runs");
loadRuns();
loadNew();
setInterval(loadRuns, 5000);

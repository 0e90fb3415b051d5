// imglora ui: plain JS over the server's JSON API; the run folders stay the only database.
"use strict";
const $ = (sel) => document.querySelector(sel);
// The one way a value enters the page's markup: every ${...} inside HTML below goes through esc (text
// and attribute values alike; URLs are built with encodeURI/encodeURIComponent first, then esc).
const esc = (s) => String(s ?? "").replace(/[&<>"'`]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;",
  "'": "&#39;", "`": "&#96;"}[c]));
const fileUrl = (p) => esc(`/files/${encodeURI(p)}`);
const fmt = (x, d = 3) => (typeof x === "number" ? x.toFixed(d) : "");
const hms = (s) => (typeof s !== "number" ? "" : s < 3600 ? `${Math.floor(s / 60)}m${String(Math.round(s) % 60).padStart(2, "0")}s`
  : `${Math.floor(s / 3600)}h${String(Math.floor(s / 60) % 60).padStart(2, "0")}m`);

// Every state-changing request carries the XSRF cookie's value in a header (the server compares the two:
// a page of another site can neither read the cookie nor set the header).
// (Its name ends with the port, as the server names it: one browser, several UIs on one host.)
const xsrfName = `imglora_xsrf_${location.port}=`;
const xsrf = () => (document.cookie.split("; ").find((c) => c.startsWith(xsrfName)) || "").slice(xsrfName.length);
async function api(path, options = {}) {
  const headers = {"content-type": "application/json"};
  if (options.method && options.method !== "GET") headers["x-xsrf-token"] = decodeURIComponent(xsrf());
  const r = await fetch(path, {...options, headers, credentials: "same-origin"});
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
      <td>${esc(r.name)}</td><td class="state-${esc(r.state)}">${esc(r.state)} ${esc(r.detail)}</td>
      <td>${esc(r.step)}${r.total ? " / " + esc(r.total) : ""}</td><td>${esc(fmt(r.loss, 4))}</td>
      <td>${esc(fmt(r.sec_per_update))}</td><td>${esc(hms(r.eta_seconds))}</td><td>${esc(fmt(r.cost, 2))}</td>
      <td>${esc(fmt(r.projected_cost, 2))}</td><td>${r.peak_allocated ? esc(fmt(r.peak_allocated / 2 ** 30, 2)) : ""}</td>
    </tr>`).join("");
  document.querySelectorAll("tr.run").forEach((tr) => tr.addEventListener("click", () => openRun(tr.dataset.name)));
}

function drawCurve() {
  const svg = $("#curve"), W = 720, H = 240, pad = 30;
  const pts = rows.filter((r) => typeof r.loss === "number" && typeof r.step === "number");
  if (!pts.length) { svg.innerHTML = `<text x="20" y="40">no logged update yet</text>`; svg.dataset.points = "0"; return; }
  const steps = pts.map((r) => r.step), losses = pts.map((r) => r.loss);
  const x0 = Math.min(...steps), x1 = Math.max(...steps, x0 + 1), y0 = Math.min(...losses), y1 = Math.max(...losses, y0 + 1e-9);
  const X = (s) => pad + ((s - x0) / (x1 - x0)) * (W - 2 * pad), Y = (l) => H - pad - ((l - y0) / (y1 - y0)) * (H - 2 * pad);
  let m = null;
  const smooth = losses.map((l) => (m = m === null ? l : 0.9 * m + 0.1 * l));
  const line = (vals, cls) => `<polyline class="${cls}" fill="none" stroke="${cls === "raw" ? "#9bd" : "#135"}"
    stroke-width="${cls === "raw" ? 1 : 2}" points="${esc(vals.map((v, i) => `${X(steps[i]).toFixed(1)},${Y(v).toFixed(1)}`).join(" "))}"/>`;
  svg.innerHTML = line(losses, "raw") + line(smooth, "smooth") +
    `<text x="${pad}" y="${H - 8}" font-size="11">update ${esc(x0)}</text><text x="${W - pad - 70}" y="${H - 8}" font-size="11">update ${esc(x1)}</text>
     <text x="4" y="${pad}" font-size="11">${esc(y1.toFixed(3))}</text><text x="4" y="${H - pad}" font-size="11">${esc(y0.toFixed(3))}</text>`;
  svg.dataset.points = String(pts.length);
}

function showSummary(s) {
  $("#run-state").innerHTML = `<span class="state-${esc(s.state)}">${esc(s.state)}</span> ${esc(s.detail)} —
    update ${esc(s.step ?? "–")}${s.total ? " / " + esc(s.total) : ""}, loss ${esc(fmt(s.loss, 4))}, ${esc(fmt(s.sec_per_update))} s/update,
    ETA ${esc(hms(s.eta_seconds) || "–")}, cost so far ${esc(fmt(s.cost, 2) || "–")}, projected ${esc(fmt(s.projected_cost, 2) || "–")}`;
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
  if (d.error) $("#job").textContent = d.error;
  $("#evals tbody").innerHTML = d.evals.map((e) => `<tr><td>${esc(e.started)}</td><td>${esc(e.status)}</td>
    <td>checkpoints ${esc(e.steps.join(", "))}</td><td>best: ${esc(e.best_step ?? "–")}</td></tr>`).join("");
  const el = d.eval_losses;
  $("#ckpt-losses").innerHTML = !el ? "" : `<thead><tr><th>checkpoint</th><th>held-out loss</th><th>training-image loss</th>
    <th>adapter</th><th>sheet</th></tr></thead><tbody>` + el.checkpoints.map((c) => `
    <tr class="${c.best ? "best" : ""}" data-step="${esc(c.step)}"><td>${esc(c.step)}${c.best ? " ★ best" : ""}</td>
    <td>${esc(fmt(c.heldout, 4) || "n/a")}</td><td>${esc(fmt(c.train, 4))}</td>
    <td>${c.adapter ? `<a href="${fileUrl(c.adapter)}">${esc(c.adapter.split("/").slice(-2).join("/"))}</a>` : ""}</td>
    <td>${c.sheet ? `<a href="${fileUrl(c.sheet)}">sheet</a>` : ""}</td></tr>`).join("") + "</tbody>" +
    (el.best_step === null ? `<caption>no held-out images (eval.holdout or eval.holdout_dir), so no best checkpoint</caption>` : "");
  $("#loss-plot").hidden = !(el && el.plot);
  if (el && el.plot) $("#loss-plot").src = `/files/${encodeURI(el.plot)}`;
  $("#sheets").innerHTML = d.sheets.filter((p) => !(el && p === el.plot)).map((p) => `<figure><img src="${fileUrl(p)}" alt="${esc(p)}"><figcaption>${esc(p)}</figcaption></figure>`).join("");
  const link = $("#adapter-link");
  link.hidden = !d.adapter;
  if (d.adapter) { link.href = `/files/${encodeURI(d.adapter)}`; link.textContent = "download adapter (diffusers form)"; }
  $("#exports").innerHTML = d.exports.map((p) => `<a href="${fileUrl(p)}" download>${esc(p.split("/").pop())}</a>`).join(" ");
  if (source) source.close();
  const last = rows.length ? rows[rows.length - 1].step : -1;
  source = new EventSource(`/api/runs/${encodeURIComponent(name)}/events?after=${encodeURIComponent(last)}`);
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
  const j = await api(`/api/jobs/${encodeURIComponent(id)}`);
  out.textContent = `imglora ${j.argv.join(" ")}: ${j.running ? "running" : "exit " + j.returncode}\n` + j.tail.join("\n");
  out.dataset.done = j.running ? "" : String(j.returncode);
  if (j.running) setTimeout(() => pollJob(id, out), 1000);
}

$("#btn-stop").onclick = () => runAction(`/api/runs/${encodeURIComponent(current)}/stop`);
$("#btn-resume").onclick = () => runAction(`/api/runs/${encodeURIComponent(current)}/resume`);
$("#btn-eval").onclick = () => runAction(`/api/runs/${encodeURIComponent(current)}/eval`);
$("#btn-export").onclick = () => runAction(`/api/runs/${encodeURIComponent(current)}/export`, {comfyui: $("#export-comfyui").value});

// ------------------------------------------------------------------------------ new run
// The form is made from the typed config (/api/schema): a list for true/false and for choices, number
// fields with the schema's range, text for strings (sent as TOML strings) and TOML for lists and
// tables. An empty field keeps the preset's value.
let keys = [];
async function loadNew() {
  const presets = (await api("/api/presets")).presets;
  for (const sel of [$("#preset"), $("#tools-preset")]) sel.innerHTML = presets.map((p) => `<option>${esc(p)}</option>`).join("");
  await loadKeys();
}
async function loadKeys() {
  const preset = $("#preset").value;
  const entered = Object.fromEntries(keys.filter((k) => k.entered !== undefined).map((k) => [k.key, k.entered]));
  let got;
  try { got = (await api(`/api/schema?preset=${encodeURIComponent(preset)}`)).keys; }
  catch (e) {  // a preset with problems: its values cannot be shown, the form still can
    got = (await api("/api/schema")).keys;
    $("#problems").textContent = e.message;
    $("#problems").dataset.ok = "false";
  }
  if (preset !== $("#preset").value) return;  // another preset was chosen meanwhile: its answer counts
  keys = got;
  keys.forEach((k) => { if (k.key in entered) k.entered = entered[k.key]; });
  renderKeys();
  $("#keys").dataset.preset = preset;
}
$("#preset").addEventListener("change", loadKeys);

function widget(k) {
  const attrs = `data-key="${esc(k.key)}" data-type="${esc(k.type)}"`;
  const now = k.entered ?? "";
  if (k.type === "bool" || k.type === "choice") {
    const options = k.type === "bool" ? ["true", "false"] : k.choices.map(String);
    return `<select ${attrs}><option value="">(preset)</option>${options.map((o) =>
      `<option${o === now ? " selected" : ""}>${esc(o)}</option>`).join("")}</select>`;
  }
  if (k.type === "int" || k.type === "float") {
    const range = (k.min !== null ? ` min="${esc(k.min)}"` : "") + (k.max !== null ? ` max="${esc(k.max)}"` : "");
    return `<input type="number" step="${k.type === "int" ? 1 : "any"}"${range} ${attrs} value="${esc(now)}">`;
  }
  const hint = k.type === "toml" ? ' placeholder="TOML, e.g. [&quot;a&quot;]"' : "";
  return `<input type="text" ${attrs}${hint} value="${esc(now)}">`;
}
function renderKeys() {
  const f = $("#key-filter").value.trim();
  const changed = $("#changed-only").checked;
  $("#keys tbody").innerHTML = keys.filter((k) => (!f || k.key.includes(f)) && (!changed || k.entered)).slice(0, 80).map((k) => `
    <tr><td>${esc(k.key)}</td><td>${widget(k)}</td><td>${esc(k.value ?? "")}</td>
    <td>${esc(k.default)}</td><td>${esc(k.help)}${k.min !== null || k.max !== null ? ` <i>(${esc(k.min ?? "")}…${esc(k.max ?? "")})</i>` : ""}</td></tr>`).join("");
  // On every keystroke, not on leaving the field: the list of changes below grows as one types, so
  // the buttons do not move between pressing and releasing the mouse on them.
  document.querySelectorAll("#keys [data-key]").forEach((i) => ["input", "change"].forEach((ev) => i.addEventListener(ev, () => {
    keys.find((k) => k.key === i.dataset.key).entered = i.value;
    $("#changed").textContent = overrides().join("\n");
  })));
}
$("#key-filter").addEventListener("input", renderKeys);
$("#changed-only").addEventListener("change", renderKeys);
// What the form sends: `key=value` as `imglora train --set` takes it (a string's text becomes a TOML string).
const asToml = (k) => (k.type === "str" || k.type === "choice" ? JSON.stringify(k.entered) : k.entered);
const overrides = () => keys.filter((k) => k.entered !== undefined && k.entered !== "").map((k) => `${k.key}=${asToml(k)}`)
  .concat($("#extra").value.split("\n").map((l) => l.trim()).filter((l) => l));
$("#extra").addEventListener("input", () => ($("#changed").textContent = overrides().join("\n")));
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
$("#btn-estimate").onclick = async () => {
  const out = $("#estimate");
  out.innerHTML = "<tr><td>estimating ...</td></tr>";
  try {
    const r = await api("/api/estimate", {method: "POST", body: JSON.stringify({...spec(), gpu: $("#gpu").value,
      offers: $("#offers").value.split("\n"), steps: Number($("#est-steps").value) || null,
      idle_minutes: Number($("#est-idle").value) || 0})});
    out.innerHTML = `<thead><tr><th>offer</th><th>card</th><th>setting</th><th>s/update</th><th>hours</th>
      <th>cost (${esc(r.currency)})</th><th>basis</th></tr></thead><tbody>` + r.offers.map((o) => `
      <tr class="offer" data-offer="${esc(o.offer)}"><td>${esc(o.offer)} (${esc(o.rate)}/h)</td><td>${esc(o.card)}</td>
      <td>${esc(o.setting ?? "")}</td><td>${esc(fmt(o.seconds_per_update))}</td><td>${esc(fmt(o.hours, 2))}</td>
      <td class="cost">${esc(fmt(o.cost, 2))}</td><td>${esc(o.basis)}</td></tr>`).join("") +
      `</tbody><caption>${esc(r.steps)} updates; ${esc(r.note)}</caption>`;
  } catch (e) { out.innerHTML = `<tr><td class="error">${esc(e.message)}</td></tr>`; }
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
// Each image with its loss mask laid over it (dark = not trained; the slider sets how strongly) and its
// source images (edit pairs) beside it and, on hover, over it.
$("#btn-dataset").onclick = async () => {
  try {
    const q = new URLSearchParams({dir: $("#dataset-dir").value, mask_dir: $("#dataset-masks").value,
                                   control_dir: $("#dataset-controls").value});
    const d = await api(`/api/dataset?${q}`);
    $("#dataset-warnings").innerHTML = d.problems.map((w) => `<li class="problem">${esc(w)}</li>`).join("") +
      d.warnings.map((w) => `<li>${esc(w)}</li>`).join("");
    $("#gallery").innerHTML = d.items.map((it) => `<div class="item">
      <div class="stack"><img src="${fileUrl(it.image)}" alt="">
        ${it.mask ? `<img class="mask" src="${fileUrl(it.mask)}" alt="mask ${esc(it.mask)}">` : ""}
        ${it.controls.length ? `<img class="source" src="${fileUrl(it.controls[0])}" alt="source">` : ""}</div>
      ${it.controls.length ? `<div class="sources">${it.controls.map((c) =>
        `<img src="${fileUrl(c)}" alt="source ${esc(c)}" title="source: ${esc(c)}">`).join("")}</div>` : ""}
      <div>${esc(it.image)}${it.mask ? ` <span class="tag">mask</span>` : ""}${it.controls.length ? ` <span class="tag">${esc(it.controls.length)} source(s)</span>` : ""}</div>
      <textarea data-image="${esc(it.image)}">${esc(it.caption)}</textarea>
      ${it.warnings.map((w) => `<div class="warn">${esc(w)}</div>`).join("")}<span class="saved"></span></div>`).join("");
    setOverlay();
    document.querySelectorAll("#gallery textarea").forEach((t) => t.addEventListener("change", async () => {
      const r = await api("/api/caption", {method: "PUT", body: JSON.stringify({image: t.dataset.image, caption: t.value})});
      t.parentElement.querySelector(".saved").textContent = "saved";
      t.value = r.caption;
    }));
  } catch (e) { $("#dataset-warnings").innerHTML = `<li>${esc(e.message)}</li>`; }
};
function setOverlay() {
  document.querySelectorAll("#gallery img.mask").forEach((m) => (m.style.opacity = $("#overlay").value / 100));
}
$("#overlay").addEventListener("input", setOverlay);

// ------------------------------------------------------------------------------ tools
const tool = (path, body, out = "#tools-out") => async () => {
  try { const j = await api(path, {method: "POST", body: JSON.stringify(body())}); pollJob(j.id, $(out)); }
  catch (e) { $(out).textContent = e.message; }
};
$("#btn-cache").onclick = tool("/api/cache", spec, "#cache-out");  // the New run form's values
$("#btn-doctor").onclick = tool("/api/doctor", () => ({preset: $("#tools-preset").value}));
$("#btn-fetch-dry").onclick = tool("/api/fetch", () => ({preset: $("#tools-preset").value, dry_run: true}));
$("#btn-fetch").onclick = tool("/api/fetch", () => ({preset: $("#tools-preset").value}));

show(location.hash.slice(1) || "runs");
loadRuns();
loadNew();
setInterval(loadRuns, 5000);

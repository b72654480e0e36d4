// stagemesh dashboard: polls GET /dashboard/live once a second and draws it; the chat box streams
// from POST /v1/chat/completions. Plain browser JavaScript, no libraries, no build step.
// Every value from the server goes into the page as text (textContent), never as HTML.
"use strict";

const LIVE_URL = "/dashboard/live";
const POLL_MS = 1000;
const KEY_STORAGE = "stagemesh-api-key";

let apiKey = sessionStorage.getItem(KEY_STORAGE) || "";
let modelName = "";
let pollTimer = null;
const chatHistory = [];

function authHeaders() {
  return apiKey ? { Authorization: "Bearer " + apiKey } : {};
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "style") node.setAttribute("style", value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

// -- formatting ---------------------------------------------------------------

function num(value, digits = 1) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
}
function ms(seconds) {
  return seconds === null || seconds === undefined ? "–" : (seconds * 1000).toFixed(seconds < 0.1 ? 1 : 0) + " ms";
}
function pct(share) {
  return share === null || share === undefined ? "–" : Math.round(share * 100) + "%";
}
function count(n) {
  if (n >= 1e6) return (n / 1e6).toFixed(1) + "M";
  if (n >= 1e4) return Math.round(n / 1e3) + "k";
  return String(n);
}
function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.floor(seconds);
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
  return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
}
function clock(unixSeconds) {
  return new Date(unixSeconds * 1000).toLocaleTimeString();
}

// -- drawing ------------------------------------------------------------------

function card(label, value, sub, id) {
  return el("div", { class: "card", "data-card": id }, el("div", { class: "label" }, label),
    el("div", { class: "value" }, value), sub ? el("div", { class: "sub" }, sub) : null);
}

function percentiles(summary) {
  if (!summary || !summary.count) return "no samples in the last minute";
  return "p50 " + ms(summary.p50) + " · p90 " + ms(summary.p90) + " · p99 " + ms(summary.p99);
}

function drawOverall(doc) {
  const o = doc.overall;
  const recent = o.recent;
  const errors = recent ? recent.client_errors + recent.server_errors : 0;
  document.getElementById("overall").replaceChildren(
    card("output tokens/s", num(o.output_tokens_per_s), "all replicas", "tokens"),
    card("time to first token", o.ttft_s && o.ttft_s.count ? ms(o.ttft_s.p50) : "–", percentiles(o.ttft_s), "ttft"),
    card("inter-token latency", o.itl_s && o.itl_s.count ? ms(o.itl_s.p50) : "–", percentiles(o.itl_s), "itl"),
    card("requests in flight", String(o.requests_running), o.requests_total + " served since start", "running"),
    card("errors (last minute)", String(errors),
      (recent ? recent.server_errors + " server, " + recent.client_errors + " client; " : "") +
      (o.server_errors_total + o.client_errors_total) + " since start", "errors"),
  );
}

function shareBar(rates) {
  if (!rates) return el("span", { class: "muted" }, "–");
  const part = (cls, share) => el("span", { class: cls, style: "width:" + Math.min(100, Math.max(0, share * 100)) + "%" });
  return el("span", {},
    el("span", { class: "bar", title: "compute / wait / send share of wall time" },
      part("compute", rates.compute_share), part("wait", rates.wait_share), part("send", rates.send_share)),
    " " + pct(rates.compute_share) + " / " + pct(rates.wait_share) + " / " + pct(rates.send_share));
}

function kvBar(stage) {
  if (stage.kv_use === null || stage.kv_use === undefined) return el("span", { class: "muted" }, "–");
  const s = stage.stats;
  return el("span", { title: s.kv_tokens + " of " + s.kv_token_capacity + " tokens of KV" },
    el("span", { class: "bar" }, el("span", { class: "kv", style: "width:" + Math.min(100, stage.kv_use * 100) + "%" })),
    " " + pct(stage.kv_use) + " (" + count(s.kv_tokens) + " / " + count(s.kv_token_capacity) + " tok)");
}

function depthBar(replica, depth) {
  const bar = el("div", { class: "depth", "aria-label": "layers over the model's depth" });
  for (const stage of replica.stages) {
    const [start, end] = stage.layers;
    if (!depth || end <= start || stage.member) continue;  // one segment per stage: its worker 0's
    bar.append(el("div", {
      class: "seg" + (stage.healthy ? "" : " unhealthy"),
      style: "left:" + (100 * start / depth) + "%;width:" + (100 * (end - start) / depth) + "%",
      title: "stage " + stage.rank + ": layers " + start + "–" + (end - 1) + " on " + stage.host,
    }, "stage " + stage.rank + " · " + start + "–" + end));
  }
  return bar;
}

const COLUMNS = ["stage", "host", "layers", "dtype", "state", "health", "pid", "uptime", "restarts",
  "running / waiting", "batches/s", "compute / wait / send", "KV cache"];

// While a stage loads, how much of its weights it has read (the stage counts them: load_*_bytes).
function stateText(stage) {
  const total = stage.stats.load_total_bytes || 0;
  if (stage.state !== "loading" || !total) return stage.state;
  const done = Math.min(stage.stats.load_done_bytes || 0, total);
  return "loading " + Math.floor(100 * done / total) + "% of " + (total / 1e9).toFixed(1) + " GB";
}

function stageRow(replica, stage) {
  const r = stage.rates;
  const quant = stage.quantized ? "quantized" : "dense";
  return el("tr", {
    class: "stage" + (stage.healthy ? "" : " unhealthy"),
    "data-replica": replica.replica, "data-rank": stage.rank, "data-member": stage.member || 0,
    "data-healthy": stage.healthy ? "true" : "false",
  },
  // A tensor-parallel group's workers: "1 · worker 1" beside the stage's worker 0.
  el("td", {}, String(stage.rank) + (stage.member ? " · worker " + stage.member : "")),
  el("td", {}, stage.host + (stage.device ? " (" + stage.device + ")" : "")),
  el("td", { class: "layers" }, "[" + stage.layers[0] + ", " + stage.layers[1] + ")"),
  el("td", {}, stage.compute_dtype + ", " + quant),
  el("td", { class: "state", title: stage.error || "" }, stateText(stage)),
  el("td", { class: "health " + (stage.healthy ? "ok" : "bad") }, stage.healthy ? "healthy" : "UNHEALTHY"),
  el("td", { class: "pid" }, stage.pid === null ? "–" : String(stage.pid)),
  el("td", {}, duration(stage.uptime_s)),
  el("td", {}, String(stage.restarts)),
  el("td", {}, stage.stats.running_sequences + " / " + stage.stats.waiting_requests),
  el("td", {}, r ? num(r.batches_per_s) : "–"),
  el("td", {}, shareBar(r)),
  el("td", {}, kvBar(stage)));
}

// What supervision is doing about a replica that is not serving: restarting it, or waiting out its
// backoff before the next restart (a replica that keeps dying is retried forever, ever more slowly).
function supervision(replica, now) {
  if (!replica.state || replica.state === "serving") return null;
  let text = replica.state.replace(/_/g, " ");
  let title = "";
  if (replica.state === "backing_off" && replica.next_restart_at !== null && replica.next_restart_at !== undefined) {
    text += " · restart " + (replica.restarts + 1) + " in " + duration(Math.max(0, replica.next_restart_at - now));
    title = "waits " + num(replica.backoff_s, 0) + " s before the restart, due at " + clock(replica.next_restart_at);
  }
  if (replica.consecutive_failures > 1) text += " · " + replica.consecutive_failures + " failures in a row";
  return el("span", { class: "badge supervision " + (replica.state === "failed" ? "bad" : "warn"),
    "data-state": replica.state, title: title || null }, text);
}

// What speculative decoding achieved on the replica (its entry stage counts, vLLM's spec_decode_* counters):
// the share of proposed tokens the target accepted and the tokens each verification kept (bonus included).
function speculation(replica) {
  for (const stage of replica.stages) {
    const s = stage.stats || {};
    if (!s.spec_decode_num_drafts || !s.spec_decode_num_draft_tokens) continue;
    const accepted = s.spec_decode_num_accepted_tokens || 0;
    const perPosition = (s.spec_decode_num_accepted_tokens_per_pos || [])
      .map((n) => pct(n / s.spec_decode_num_drafts)).join(" ");
    return el("span", { class: "speculation", title: "accepted by proposal position: " + (perPosition || "–") +
      " (" + count(s.spec_decode_num_drafts) + " verifications)" },
    "speculation " + pct(accepted / s.spec_decode_num_draft_tokens) + " accepted · " +
      num((accepted + s.spec_decode_num_drafts) / s.spec_decode_num_drafts, 2) + " tok/verification");
  }
  return null;
}

// The prefix cache's hit rate (prompt tokens restored / looked up, since the entry stage started) and how the
// gateway routed this replica's requests: by the client's cache key, by where the prompt's prefix went, by load.
function caching(replica) {
  const r = replica.routed || {};
  const routed = (r.key || 0) + (r.prefix || 0) + (r.load || 0);
  if (replica.prefix_cache_hit_rate == null && !routed) return null;
  return el("span", { class: "caching", title: "routed: " + (r.prefix || 0) + " by prefix, " + (r.key || 0) +
      " by cache key, " + (r.load || 0) + " by load" },
    "prefix cache " + (replica.prefix_cache_hit_rate == null ? "–" : pct(replica.prefix_cache_hit_rate)) +
      " hit · " + (r.prefix || 0) + "/" + routed + " routed by prefix");
}

function drawReplicas(doc) {
  const blocks = doc.replicas.map((replica) => {
    const health = el("span", { class: "badge " + (replica.healthy ? "ok" : "bad") },
      replica.healthy ? "healthy" : "unhealthy");
    const head = el("div", { class: "replica-head" },
      el("strong", {}, "replica " + replica.replica), health, supervision(replica, doc.time),
      el("span", {}, num(replica.output_tokens_per_s) + " tok/s"),
      el("span", {}, replica.in_flight + " in flight"),
      el("span", { title: percentiles(replica.ttft_s) }, "TTFT " + (replica.ttft_s && replica.ttft_s.count ?
        ms(replica.ttft_s.p50) : "–")),
      el("span", { title: percentiles(replica.itl_s) }, "ITL " + (replica.itl_s && replica.itl_s.count ?
        ms(replica.itl_s.p50) : "–")),
      el("span", { title: replica.failures_total + " since start" },
        (replica.recent_failures ?? 0) + " failed (last minute)"),
      el("span", {}, replica.restarts + " restart" + (replica.restarts === 1 ? "" : "s")),
      caching(replica),
      speculation(replica),
      el("span", { class: "legend muted" }, "shares of wall time:",
        el("span", { class: "compute" }, "compute"), el("span", { class: "wait" }, "ring wait"),
        el("span", { class: "send" }, "send")));
    const table = el("table", {},
      el("thead", {}, el("tr", {}, ...COLUMNS.map((c) => el("th", {}, c)))),
      el("tbody", {}, ...replica.stages.map((stage) => stageRow(replica, stage))));
    return el("div", { class: "replica", "data-replica": replica.replica, "data-state": replica.state }, head, depthBar(replica, doc.num_layers), table);
  });
  document.getElementById("replicas").replaceChildren(...blocks);
}

function drawEvents(doc) {
  const items = doc.events.slice().reverse().map((e) => el("li", { "data-kind": e.kind },
    el("time", { datetime: new Date(e.time * 1000).toISOString() }, clock(e.time)),
    el("span", { class: "kind " + e.kind }, e.kind.replace(/_/g, " ")),
    e.message));
  document.getElementById("events").replaceChildren(...items);
  document.getElementById("no-events").hidden = items.length > 0;
}

function draw(doc) {
  modelName = doc.model;
  document.getElementById("model").textContent = doc.model + " · " + doc.num_layers + " layers";
  const healthy = doc.overall.healthy_replicas;
  const badge = document.getElementById("mesh-health");
  badge.textContent = healthy + "/" + doc.replicas.length + " replicas healthy";
  badge.className = "badge " + (healthy === doc.replicas.length ? "ok" : healthy ? "warn" : "bad");
  document.getElementById("updated").textContent = "updated " + clock(doc.time);
  drawOverall(doc);
  drawReplicas(doc);
  drawEvents(doc);
}

// -- polling and the key ------------------------------------------------------

function askForKey(message) {
  const form = document.getElementById("key-form");
  form.hidden = false;
  document.getElementById("key-error").textContent = message || "";
  document.getElementById("key-input").focus();
}

async function poll() {
  pollTimer = null;
  try {
    const response = await fetch(LIVE_URL, { headers: authHeaders(), cache: "no-store" });
    if (response.status === 401) {
      askForKey(apiKey ? "That key was refused." : "");
      return; // polling resumes once a key is entered
    }
    if (!response.ok) throw new Error("HTTP " + response.status);
    document.getElementById("key-form").hidden = true;
    draw(await response.json());
  } catch (err) {
    const badge = document.getElementById("mesh-health");
    badge.textContent = "gateway unreachable (" + err.message + ")";
    badge.className = "badge bad";
  }
  pollTimer = setTimeout(poll, POLL_MS);
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey = document.getElementById("key-input").value.trim();
  sessionStorage.setItem(KEY_STORAGE, apiKey);
  if (pollTimer === null) poll();
});

// -- chat ---------------------------------------------------------------------

function errorText(body, status) {
  try {
    return JSON.parse(body).error.message;
  } catch (_) {
    return "HTTP " + status;
  }
}

async function streamChat(prompt, maxTokens, temperature, answer) {
  chatHistory.push({ role: "user", content: prompt });
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders() },
    body: JSON.stringify({ model: modelName || undefined, messages: chatHistory, stream: true, max_tokens: maxTokens,
      temperature }),
  });
  if (!response.ok) {
    chatHistory.pop();
    if (response.status === 401) askForKey("The chat needs the API key.");
    throw new Error(errorText(await response.text(), response.status));
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  let text = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffered += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffered.indexOf("\n\n")) >= 0) {
      const event = buffered.slice(0, cut);
      buffered = buffered.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          text += delta.content;
          answer.textContent = text;
        }
      }
    }
  }
  chatHistory.push({ role: "assistant", content: text });
  answer.dataset.done = "true";
}

document.getElementById("chat-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const input = document.getElementById("chat-input");
  const prompt = input.value.trim();
  if (!prompt) return;
  const maxTokens = parseInt(document.getElementById("chat-max-tokens").value, 10) || 128;
  const temperature = parseFloat(document.getElementById("chat-temperature").value);
  const log = document.getElementById("chat-log");
  const answer = el("div", { class: "msg assistant" });
  log.append(el("div", { class: "msg user" }, prompt), answer);
  input.value = "";
  const send = document.getElementById("chat-send");
  send.disabled = true;
  try {
    await streamChat(prompt, maxTokens, Number.isNaN(temperature) ? undefined : temperature, answer);
  } catch (err) {
    answer.classList.add("error");
    answer.textContent = "error: " + err.message;
    answer.dataset.done = "error";
  } finally {
    send.disabled = false;
    log.scrollTop = log.scrollHeight;
  }
});

poll();

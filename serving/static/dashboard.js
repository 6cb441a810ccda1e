// The dashboard: renders each snapshot of /dashboard/events. fetch() rather than EventSource, so
// that a 403 can be read and shown, and so that the stream's end is seen (a server restarting, a
// network change): it reconnects by itself.
"use strict";

const RETRY_MS = 2000;
const rates = []; // the estimate over the last snapshots, for the sparkline
let previous = null; // the last snapshot, for the feed's share of CPU between two of them

function status(text, bad = false) {
  const s = $("status");
  s.textContent = text;
  s.classList.toggle("bad", bad);
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text ?? "–";
  if (cls) td.className = cls;
  return td;
}

function row(...cells) {
  const tr = document.createElement("tr");
  tr.append(...cells);
  return tr;
}

function percent(x) {
  return x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`;
}

function ago(s) {
  return s < 60 ? `${s.toFixed(1)} s` : `${Math.floor(s / 60)} min`;
}

function bar(n, scale, cls) {
  const span = document.createElement("span");
  span.className = cls ? `bar ${cls}` : "bar";
  span.style.width = `${Math.min(n * scale, 12)}rem`;
  return span;
}

function renderReplicas(replicas) {
  const top = Math.max(1, ...replicas.map((r) => r.running + r.waiting));
  const scale = 12 / top; // the busiest replica's bar fills the column
  $("replicas").replaceChildren(
    ...replicas.map((r) => {
      const load = document.createElement("td");
      load.append(bar(r.running, scale), bar(r.waiting, scale, "waiting"));
      return row(
        cell(r.name, "id"),
        cell(r.model),
        cell(r.healthy ? "up" : "down", r.healthy ? "ok" : "bad"),
        cell(String(r.running), "num"),
        cell(String(r.waiting), "num"),
        load,
        cell(String(r.restarts), "num"),
      );
    }),
  );
}

function renderClasses(snapshot) {
  $("classes-title").textContent = `QoS classes, last ${snapshot.window_s} s`;
  $("classes").replaceChildren(
    ...snapshot.classes.map((c) => {
      const met = c.attainment;
      const grade = met === null ? "" : met >= 0.95 ? "ok" : met >= 0.8 ? "warn" : "bad";
      return row(
        cell(c.name),
        cell(`${c.deadline_s} s`, "num"),
        cell(String(c.ended), "num"),
        cell(String(c.counted), "num"),
        cell(percent(met), `num ${grade}`),
        cell(percent(c.shed_rate), c.shed ? "num bad" : "num"),
      );
    }),
  );
}

function renderDecisions(decisions) {
  $("decisions").replaceChildren(
    ...decisions.map((d) =>
      row(
        cell(ago(d.age_s), "num"),
        cell(d.request_id, "id"),
        cell(d.qos_class),
        cell(d.task ?? "–"),
        cell(d.asked),
        cell(d.model),
        cell(d.replica, "id"),
        cell(String(d.in_flight), "num"),
        cell(String(d.at_replica), "num"),
        cell(d.rate.toFixed(2), "num"),
      ),
    ),
  );
}

function renderEnded(ended) {
  $("ended").replaceChildren(
    ...ended.map((e) =>
      row(
        cell(ago(e.age_s), "num"),
        cell(e.request_id, "id"),
        cell(e.qos_class ?? "–"),
        cell(e.protocol ? `HTTP/${e.protocol}` : "–"),
        cell(e.model ?? "–"),
        cell(e.replica ?? "–", "id"),
        cell(e.outcome, e.outcome === "ok" ? "ok" : "bad"),
        cell(e.ttft_s === null ? "–" : `${(1000 * e.ttft_s).toFixed(0)} ms`, "num"),
        cell(String(e.tokens), "num"),
        e.counted ? cell(e.slo_met ? "met" : "missed", e.slo_met ? "ok" : "warn") : cell("n/a"),
      ),
    ),
  );
}

function renderRate(rate) {
  $("rate").textContent = rate.toFixed(2);
  rates.push(rate);
  if (rates.length > 120) rates.shift();
  const top = Math.max(...rates, 1e-9);
  const points = rates.map((r, i) => `${i},${(100 - (95 * r) / top).toFixed(1)}`).join(" ");
  $("rate-spark").querySelector("polyline").setAttribute("points", points);
}

function renderFeed(snapshot) {
  // Between two snapshots: what building them cost, against all the server's process did. An
  // idle server does little, so there even a small cost is a visible share.
  if (previous) {
    const feed = snapshot.feed.cpu_s - previous.feed.cpu_s;
    const all = snapshot.process_cpu_s - previous.process_cpu_s;
    const built = snapshot.feed.snapshots - previous.feed.snapshots;
    const seconds = snapshot.time - previous.time;
    $("feed-share").textContent = all > 0 ? percent(feed / all) : "–";
    if (built > 0 && seconds > 0) {
      $("feed-detail").textContent =
        `${((1000 * feed) / built).toFixed(2)} ms of CPU a snapshot; the server's process ` +
        `used ${((1000 * all) / seconds).toFixed(0)} ms of CPU a second`;
    }
  }
  previous = snapshot;
}

function render(snapshot) {
  // With --workers, the snapshot merges every worker that answered in time.
  $("deployment").textContent =
    snapshot.workers > 1 ? `${snapshot.deployment} · ${snapshot.workers} workers` : snapshot.deployment;
  renderRate(snapshot.rate);
  renderFeed(snapshot);
  renderReplicas(snapshot.replicas);
  renderClasses(snapshot);
  renderDecisions(snapshot.decisions);
  renderEnded(snapshot.ended);
}

function forbidden(message) {
  const box = $("forbidden");
  box.textContent = message;
  box.classList.add("shown");
  status("forbidden", true);
}

async function follow() {
  const response = await fetch("/dashboard/events", { cache: "no-store" });
  if (response.status === 403) {
    const error = await response.json().catch(() => null);
    forbidden(error?.error?.message ?? "forbidden");
    return false; // asking again would be refused again
  }
  if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
  $("forbidden").classList.remove("shown");
  const nav = performance.getEntriesByType("navigation")[0];
  status(`live · page over ${protocolName(nav?.nextHopProtocol)}`);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return true;
    let events;
    [events, buffer] = eventsOf(buffer + value);
    // Only the newest snapshot matters: render it, and let older ones go.
    if (events.length) render(JSON.parse(events[events.length - 1]));
  }
}

async function run() {
  for (;;) {
    try {
      if (!(await follow())) return;
      status("reconnecting…", true);
    } catch (err) {
      status(`disconnected (${err.message}); retrying`, true);
    }
    await new Promise((resolve) => setTimeout(resolve, RETRY_MS));
  }
}

document.addEventListener("DOMContentLoaded", run);

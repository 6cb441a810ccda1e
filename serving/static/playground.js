// The playground: one chat, streamed with fetch() from /v1/chat/completions, every answer with
// who served it, how soon its first token came, the gaps between its tokens, and the protocol
// that carried it. No framework and no build step: this file is what the browser runs.
"use strict";

const CHAT_URL = "/v1/chat/completions";
const messages = []; // the conversation so far, sent whole with every request (OpenAI's way)
let controller = null; // aborts the answer being streamed (Stop)

function showPageProtocol() {
  const nav = performance.getEntriesByType("navigation")[0];
  const p = nav ? nav.nextHopProtocol : "";
  const badge = $("page-protocol");
  badge.textContent = "page: " + protocolName(p);
  badge.classList.toggle("h3", protocolName(p) === "HTTP/3");
}

function option(value, label) {
  const o = document.createElement("option");
  o.value = value;
  o.textContent = label ?? value;
  return o;
}

async function loadOptions() {
  const [models, offered] = await Promise.all([
    fetch("/v1/models").then((r) => r.json()),
    fetch("/playground/options").then((r) => r.json()),
  ]);
  const model = $("model");
  model.replaceChildren(
    ...models.data.map((m) => option(m.id, m.id === "auto" ? "auto (the router picks)" : m.id)),
  );
  const cls = $("qos-class");
  cls.replaceChildren(
    ...offered.classes.map((c) =>
      option(c.name, `${c.name} (${c.deadline_s} s${c.needs_key ? ", needs a key" : ""})`),
    ),
  );
  if (offered.default_class) cls.value = offered.default_class;
  $("task").append(...offered.tasks.map((t) => option(t)));
}

// -- one answer on the page ---------------------------------------------------------------------

class Turn {
  constructor(question) {
    this.root = document.createElement("article");
    this.root.className = "turn";
    const user = document.createElement("div");
    user.className = "user";
    user.textContent = question;
    this.answer = document.createElement("div");
    this.answer.className = "answer";
    this.text = document.createElement("p");
    this.text.className = "text";
    this.facts = document.createElement("dl");
    this.facts.className = "facts";
    this.answer.append(this.text, this.facts);
    this.root.append(user, this.answer);
    $("transcript").append(this.root);
    this.root.scrollIntoView({ block: "end" });
  }

  fact(name, value) {
    let dd = this.facts.querySelector(`dd[data-fact="${name}"]`);
    if (!dd) {
      const row = document.createElement("div");
      const dt = document.createElement("dt");
      dt.textContent = name;
      dd = document.createElement("dd");
      dd.dataset.fact = name;
      row.append(dt, dd);
      this.facts.append(row);
    }
    dd.textContent = value;
  }

  error(message) {
    const p = document.createElement("p");
    p.className = "error";
    p.textContent = message;
    this.answer.append(p);
  }

  // One bar per gap between tokens, as they came: a stall shows as a tall bar.
  gaps(gapsMs) {
    let svg = this.answer.querySelector("svg.gaps");
    if (!svg) {
      svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
      svg.classList.add("gaps");
      svg.setAttribute("preserveAspectRatio", "none");
      this.answer.append(svg);
    }
    const n = gapsMs.length;
    const top = Math.max(...gapsMs, 1);
    svg.setAttribute("viewBox", `0 0 ${Math.max(n, 1)} 100`);
    svg.replaceChildren(
      ...gapsMs.map((g, i) => {
        const r = document.createElementNS("http://www.w3.org/2000/svg", "rect");
        const h = Math.max((100 * g) / top, 1);
        r.setAttribute("x", i + 0.1);
        r.setAttribute("width", 0.8);
        r.setAttribute("y", 100 - h);
        r.setAttribute("height", h);
        return r;
      }),
    );
  }
}

function ms(x) {
  return `${x.toFixed(1)} ms`;
}

function quantile(sorted, q) {
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))];
}

// -- sending and streaming ----------------------------------------------------------------------

async function send(question) {
  const turn = new Turn(question);
  messages.push({ role: "user", content: question });
  const body = {
    model: $("model").value,
    messages,
    max_tokens: Number($("max-tokens").value) || 128,
    stream: true,
    stream_options: { include_usage: true },
    ignore_eos: $("ignore-eos").checked,
  };
  if ($("task").value) body.task = $("task").value;
  const headers = { "content-type": "application/json", "x-qos-class": $("qos-class").value };
  const key = $("api-key").value.trim();
  if (key) headers.authorization = `Bearer ${key}`;

  controller = new AbortController();
  performance.clearResourceTimings(); // so that the entry read at the end is this request's
  const sent = performance.now();
  let answer = "";
  const arrivals = [];
  try {
    const response = await fetch(CHAT_URL, {
      method: "POST",
      headers,
      body: JSON.stringify(body),
      signal: controller.signal,
      cache: "no-store",
    });
    turn.answer.dataset.requestId = response.headers.get("x-request-id") ?? "";
    turn.fact("request", response.headers.get("x-request-id") ?? "?");
    if (!response.ok) {
      const error = await response.json().catch(() => null);
      turn.error(`${response.status}: ${error?.error?.message ?? response.statusText}`);
      messages.pop(); // the question was not answered; it is not part of the chat
      return;
    }
    turn.fact("model", response.headers.get("x-model") ?? "?");
    turn.fact("replica", response.headers.get("x-replica") ?? "?");
    turn.fact("class", response.headers.get("x-qos-class") ?? "?");
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      let events;
      [events, buffer] = eventsOf(buffer + value);
      for (const data of events) {
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) {
          turn.error(`stream error: ${chunk.error.message}`);
          continue;
        }
        // Every chunk names its model and replica too, should a proxy have dropped headers.
        if (chunk.model) turn.fact("model", chunk.model);
        if (chunk.replica) turn.fact("replica", chunk.replica);
        if (chunk.usage) turn.fact("tokens", String(chunk.usage.completion_tokens));
        const piece = chunk.choices?.[0]?.delta?.content ?? "";
        if (!piece) continue;
        arrivals.push(performance.now());
        answer += piece;
        turn.text.textContent = answer;
      }
      showTimes(turn, sent, arrivals);
    }
    messages.push({ role: "assistant", content: answer });
  } catch (err) {
    turn.error(err.name === "AbortError" ? "stopped" : `failed: ${err.message}`);
    messages.pop();
  } finally {
    controller = null;
    const name = protocolName(await carriedBy(CHAT_URL));
    turn.fact("protocol", name);
    turn.answer.dataset.protocol = name;
    turn.answer.dataset.done = "1";
  }
}

// The browser's record of the request to `url` (Resource Timing): its entry is added once the
// body has ended, which can come a moment after the reader saw the end. Wait for it a while.
async function carriedBy(url) {
  const href = new URL(url, location.href).href;
  for (let tries = 0; tries < 40; tries++) {
    const entries = performance.getEntriesByName(href);
    if (entries.length) return entries[entries.length - 1].nextHopProtocol;
    await new Promise((resolve) => setTimeout(resolve, 25));
  }
  return "";
}

function showTimes(turn, sent, arrivals) {
  if (!arrivals.length) return;
  turn.fact("TTFT", ms(arrivals[0] - sent));
  const gaps = arrivals.slice(1).map((t, i) => t - arrivals[i]);
  if (!gaps.length) return;
  const sorted = [...gaps].sort((a, b) => a - b);
  const mean = gaps.reduce((a, b) => a + b, 0) / gaps.length;
  turn.fact(
    "gaps",
    `mean ${ms(mean)} · p50 ${ms(quantile(sorted, 0.5))} · p95 ${ms(quantile(sorted, 0.95))}` +
      ` · max ${ms(sorted[sorted.length - 1])}`,
  );
  turn.gaps(gaps);
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

document.addEventListener("DOMContentLoaded", () => {
  showPageProtocol();
  loadOptions().catch((err) => new Turn("(options)").error(`could not load options: ${err}`));
  $("ask").addEventListener("submit", async (event) => {
    event.preventDefault();
    const question = $("message").value.trim();
    if (!question || controller) return;
    $("message").value = "";
    busy(true);
    try {
      await send(question);
    } finally {
      busy(false);
    }
  });
  $("message").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("ask").requestSubmit();
  });
  $("stop").addEventListener("click", () => controller?.abort());
  $("clear").addEventListener("click", () => {
    controller?.abort();
    messages.length = 0;
    $("transcript").replaceChildren();
  });
});

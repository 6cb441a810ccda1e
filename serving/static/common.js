// What both pages share: reading a protocol name, and cutting a server-sent-event stream into
// events (fetch() rather than EventSource on both, so that errors and the stream's end are seen).
"use strict";

const $ = (id) => document.getElementById(id);

function protocolName(p) {
  if (!p) return "unknown";
  if (p === "h3" || p.startsWith("h3-")) return "HTTP/3";
  if (p === "h2") return "HTTP/2";
  if (p === "http/1.1") return "HTTP/1.1";
  return p;
}

function eventsOf(buffer) {
  // Split complete SSE events off the front of the buffer; the rest waits for more bytes.
  const events = [];
  let cut;
  while ((cut = buffer.indexOf("\n\n")) >= 0) {
    const block = buffer.slice(0, cut);
    buffer = buffer.slice(cut + 2);
    const data = block
      .split("\n")
      .filter((line) => line.startsWith("data:"))
      .map((line) => line.slice(5).trimStart())
      .join("\n");
    if (data) events.push(data);
  }
  return [events, buffer];
}

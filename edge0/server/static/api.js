// Calls to this server (same origin): JSON GETs and a streamed Chat Completions request read as
// server-sent events.

import { loadKey, saveKey } from "./store.js";

let key = loadKey();

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function setKey(value) {
  key = value;
  saveKey(value);
}

function auth() {
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function failure(response) {
  const body = await response.json().catch(() => null);
  const error = body?.error ?? {};
  return new ApiError(response.status, error.message || `${response.status} ${response.statusText}`, error.code);
}

export async function getJSON(path) {
  const response = await fetch(path, { headers: auth(), cache: "no-store" });
  if (!response.ok) throw await failure(response);
  return response.json();
}

/** Yield the chunks of a streamed chat completion; aborting `signal` closes the connection,
 * which cancels the generation on the server. */
export async function* streamChat(body, signal) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: { ...auth(), "Content-Type": "application/json" },
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(0, chunk.error.message, chunk.error.code);
      yield chunk;
    }
  }
}

// The chat page: conversations kept in localStorage, replies streamed from this server's Chat
// Completions endpoint, a stop button that closes the stream (the server then cancels the
// generation), and the live statistics panel beside it.

import { ApiError, getJSON, setKey, streamChat } from "./api.js";
import { MarkdownView } from "./markdown.js";
import { StatsPanel } from "./stats.js";
import { loadConversations, loadSettings, newConversation, saveConversations, saveSettings } from "./store.js";

const $ = (selector) => document.querySelector(selector);
const ui = {
  model: $("#model"),
  list: $("#chat-list"),
  messages: $("#messages"),
  prompt: $("#prompt"),
  form: $("#composer"),
  send: $("#send"),
  stop: $("#stop"),
  status: $("#status"),
  system: $("#system"),
  keyDialog: $("#key-dialog"),
  keyInput: $("#key-input"),
  keyError: $("#key-error"),
  attach: $("#attach"),
  attachments: $("#attachments"),
};
const FIELDS = ["temperature", "top_p", "max_tokens", "seed"];
// What the server takes (docs/images.md): these media types, 20 MB an image, 16 a request.
const IMAGE_TYPES = ["image/png", "image/jpeg", "image/gif", "image/webp"];
const MAX_IMAGE_BYTES = 20 * 1024 * 1024;
const MAX_IMAGES = 16;

let conversations = loadConversations();
let settings = loadSettings();
let current = null; // the conversation shown
let generation = null; // {controller, conversation} while a reply streams
let modelId = null;
let attached = []; // data URLs of the images the next message sends
const stats = new StatsPanel($("#stats"), getJSON, () => askKey());

function save() {
  if (!saveConversations(conversations)) status("Could not save the conversation in this browser (storage full?)");
}

function status(text) {
  ui.status.textContent = text;
}

function select(conversation) {
  current = conversation;
  ui.system.value = conversation.system || "";
  renderList();
  renderMessages();
}

function renderList() {
  ui.list.replaceChildren();
  for (const c of [...conversations].sort((a, b) => b.updated - a.updated)) {
    const item = document.createElement("li");
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = c.title || "New chat";
    open.dataset.id = c.id;
    if (c === current) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => {
      select(c);
      togglePanel("chats", false);
      ui.prompt.focus();
    });
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "delete";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Delete conversation: ${c.title || "New chat"}`);
    remove.addEventListener("click", () => deleteConversation(c));
    item.append(open, remove);
    ui.list.append(item);
  }
}

function deleteConversation(c) {
  if (generation?.conversation === c) generation.controller.abort();
  conversations = conversations.filter((x) => x !== c);
  save();
  if (c === current) select(conversations[0] ?? startConversation());
  else renderList();
}

function startConversation() {
  const c = newConversation(current?.system ?? "");
  conversations.push(c);
  return c;
}

function messageNode(message) {
  const node = document.createElement("article");
  node.className = `msg ${message.role}`;
  const who = document.createElement("h2");
  who.className = "who";
  who.textContent = message.role === "user" ? "You" : modelId || "Assistant";
  const body = document.createElement("div");
  body.className = "body";
  fill(body, message);
  node.append(who, body);
  if (message.role === "assistant") {
    const meta = document.createElement("p");
    meta.className = "meta";
    meta.textContent = describe(message);
    node.append(meta);
  }
  return node;
}

function fill(body, message) {
  if (message.role === "assistant") return (body.markdown ??= new MarkdownView(body)).update(message.content);
  body.textContent = message.content; // shown as typed
  (message.images ?? []).forEach((url, i) => body.append(imageNode(url, `image ${i + 1}`)));
}

function imageNode(url, alt) {
  const img = document.createElement("img");
  img.className = "attached";
  img.src = url; // a data: URL the user attached (the page's CSP allows no other image source)
  img.alt = alt;
  return img;
}

function renderAttachments() {
  ui.attachments.replaceChildren(
    ...attached.map((url, i) => {
      const item = document.createElement("span");
      const remove = document.createElement("button");
      remove.type = "button";
      remove.textContent = "×";
      remove.setAttribute("aria-label", `Remove image ${i + 1}`);
      remove.addEventListener("click", () => {
        attached.splice(i, 1);
        renderAttachments();
      });
      item.append(imageNode(url, `image ${i + 1} to send`), remove);
      return item;
    }),
  );
}

function attach(files) {
  for (const file of files) {
    if (!IMAGE_TYPES.includes(file.type)) {
      status(`${file.name || "That file"} is not a PNG, JPEG, GIF or WebP image.`);
      continue;
    }
    if (file.size > MAX_IMAGE_BYTES) {
      status(`${file.name || "That image"} is over 20 MB.`);
      continue;
    }
    if (attached.length >= MAX_IMAGES) {
      status(`At most ${MAX_IMAGES} images a message.`);
      break;
    }
    const reader = new FileReader();
    reader.addEventListener("load", () => {
      attached.push(reader.result);
      renderAttachments();
    });
    reader.readAsDataURL(file);
  }
}

function describe(message) {
  const parts = [];
  if (message.streaming) parts.push("writing…");
  if (message.stopped) parts.push("stopped");
  if (message.error) parts.push(`error: ${message.error}`);
  const s = message.stats;
  if (s) {
    if (s.ttftMs != null) parts.push(`first token ${Math.round(s.ttftMs)} ms`);
    if (s.tps != null) parts.push(`${s.tps.toFixed(1)} tok/s`);
    if (s.tokens != null) parts.push(`${s.tokens} tokens`);
  }
  return parts.join(" · ");
}

function renderMessages() {
  ui.messages.replaceChildren(...current.messages.map(messageNode));
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.disabled = !busy;
  ui.messages.setAttribute("aria-busy", busy ? "true" : "false");
}

function readSettings() {
  for (const name of FIELDS) {
    const raw = $(`#${name}`).value.trim();
    settings[name] = raw === "" ? null : Number(raw);
  }
  saveSettings(settings);
}

function requestBody(conversation) {
  const messages = [];
  if (conversation.system?.trim()) messages.push({ role: "system", content: conversation.system });
  for (const m of conversation.messages) {
    if (m.role === "assistant" && (m.error || m.streaming) && !m.content) continue;
    if (m.images?.length) {
      const parts = m.images.map((url) => ({ type: "image_url", image_url: { url } }));
      if (m.content) parts.push({ type: "text", text: m.content });
      messages.push({ role: m.role, content: parts });
    } else messages.push({ role: m.role, content: m.content });
  }
  const body = { messages };
  if (modelId) body.model = modelId;
  for (const name of FIELDS) if (settings[name] != null && Number.isFinite(settings[name])) body[name] = settings[name];
  return body;
}

async function snapshot() {
  try {
    return await stats.snapshot();
  } catch {
    return null;
  }
}

async function send(text, images = []) {
  if (generation || (!text.trim() && !images.length)) return;
  readSettings();
  const conversation = current;
  conversation.system = ui.system.value;
  if (!conversation.messages.length)
    conversation.title = text.trim().replace(/\s+/g, " ").slice(0, 60) || `${images.length} image(s)`;
  conversation.messages.push(images.length ? { role: "user", content: text, images } : { role: "user", content: text });
  const body = requestBody(conversation);
  const reply = { role: "assistant", content: "", streaming: true };
  conversation.messages.push(reply);
  conversation.updated = Date.now();
  save();
  renderList();
  renderMessages();
  const node = ui.messages.lastElementChild;
  const replyBody = node.querySelector(".body");
  const meta = node.querySelector(".meta");
  const controller = new AbortController();
  generation = { controller, conversation };
  setBusy(true);
  status("Generating…");

  const before = await snapshot();
  const started = performance.now();
  let first = null;
  let last = null;
  let usage = null;
  let pending = false;
  const paint = () => {
    pending = false;
    if (current === conversation) {
      fill(replyBody, reply);
      ui.messages.scrollTop = ui.messages.scrollHeight;
    }
  };
  try {
    for await (const chunk of streamChat(body, controller.signal)) {
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        last = performance.now();
        first ??= last;
        reply.content += delta;
        if (!pending) {
          pending = true;
          requestAnimationFrame(paint);
        }
      }
    }
    status("");
  } catch (e) {
    if (controller.signal.aborted) {
      reply.stopped = true;
      status("Stopped.");
    } else {
      reply.error = e.message;
      status(`Error: ${e.message}`);
      if (e instanceof ApiError && e.status === 401) askKey();
    }
  }
  delete reply.streaming;
  const tokens = usage?.completion_tokens ?? null;
  reply.stats = {
    ttftMs: first == null ? null : first - started,
    tps: tokens > 1 && last > first ? ((tokens - 1) * 1000) / (last - first) : null,
    tokens,
    promptTokens: usage?.prompt_tokens ?? null,
    cachedTokens: usage?.prompt_tokens_details?.cached_tokens ?? null,
  };
  conversation.updated = Date.now();
  generation = null;
  save();
  setBusy(false);
  paint();
  meta.textContent = describe(reply);
  if (!reply.stopped && !reply.error) {
    const after = await snapshot();
    const engine = after?.stats?.engine ?? {};
    stats.showReply({
      ...reply.stats,
      before: before?.counters,
      after: after?.counters,
      cacheBytes: engine.expert_cache_bytes ?? null,
      availableBytes: after?.stats?.machine?.memory_available_bytes ?? null,
    });
  }
}

function stop() {
  generation?.controller.abort();
}

function togglePanel(id, open) {
  const panel = $(`#${id}`);
  const button = $(`#toggle-${id}`);
  const show = open ?? !panel.classList.contains("open");
  panel.classList.toggle("open", show);
  button.setAttribute("aria-expanded", String(show));
}

function askKey(message = "") {
  document.body.dataset.state = "key";
  ui.keyError.textContent = message;
  if (!ui.keyDialog.open) ui.keyDialog.showModal();
  ui.keyInput.focus();
}

async function connect() {
  try {
    const health = await getJSON("/health");
    modelId = health.model;
    ui.model.textContent = modelId;
  } catch (e) {
    ui.model.textContent = "not connected";
    status(`The server does not answer: ${e.message}`);
  }
  try {
    await getJSON("/v1/models");
  } catch (e) {
    if (e.status === 401) return askKey();
    status(`The server does not answer: ${e.message}`);
  }
  ready();
}

function ready() {
  document.body.dataset.state = "ready";
  performance.mark("edge0-ready"); // connected: the load-time script measures up to here
  stats.start();
}

ui.keyDialog.addEventListener("cancel", (event) => event.preventDefault()); // the page needs the key
$("#key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  setKey(ui.keyInput.value.trim());
  try {
    await getJSON("/v1/models");
  } catch (e) {
    return askKey(e.status === 401 ? "The server refused this key." : e.message);
  }
  ui.keyDialog.close();
  ui.keyInput.value = "";
  ready();
  ui.prompt.focus();
});

ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.prompt.value;
  if ((!text.trim() && !attached.length) || generation) return;
  const images = attached;
  ui.prompt.value = "";
  attached = [];
  renderAttachments();
  send(text, images);
});
ui.attach.addEventListener("change", () => {
  attach([...ui.attach.files]);
  ui.attach.value = "";
});
ui.prompt.addEventListener("paste", (event) => {
  const files = [...(event.clipboardData?.files ?? [])];
  if (files.length) {
    event.preventDefault();
    attach(files);
  }
});
ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.form.requestSubmit();
  }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && generation) {
    event.preventDefault();
    stop();
  }
});
ui.stop.addEventListener("click", stop);
ui.system.addEventListener("change", () => {
  current.system = ui.system.value;
  save();
});
for (const name of FIELDS) {
  const input = $(`#${name}`);
  input.value = settings[name] ?? "";
  input.addEventListener("change", readSettings);
}
$("#new-chat").addEventListener("click", () => {
  const empty = conversations.find((c) => !c.messages.length);
  select(empty ?? startConversation());
  togglePanel("chats", false);
  ui.prompt.focus();
});
$(".skip").addEventListener("click", (event) => {
  event.preventDefault();
  ui.prompt.focus();
});
$("#toggle-chats").addEventListener("click", () => togglePanel("chats"));
$("#toggle-stats").addEventListener("click", () => togglePanel("stats"));

// A reply that was streaming when the page closed ended then: keep what had arrived.
for (const c of conversations)
  for (const m of c.messages)
    if (m.streaming) {
      delete m.streaming;
      m.stopped = true;
    }
select([...conversations].sort((a, b) => b.updated - a.updated)[0] ?? startConversation());
connect();

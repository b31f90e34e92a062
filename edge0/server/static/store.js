// The browser's side of the state: conversations, sampling settings and the API key, in
// localStorage (this origin only; nothing is sent anywhere but to this server).

const CONVERSATIONS = "edge0.conversations.v1";
const SETTINGS = "edge0.settings.v1";
const KEY = "edge0.apiKey";

export const DEFAULT_SETTINGS = { temperature: 0.7, top_p: 0.95, max_tokens: 512, seed: null };

function read(name, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(name));
    return value ?? fallback;
  } catch {
    return fallback; // unreadable (edited by hand, or storage disabled)
  }
}

function write(name, value) {
  try {
    localStorage.setItem(name, JSON.stringify(value));
    return true;
  } catch {
    return false; // full or disabled: the page keeps working, without history
  }
}

export function loadConversations() {
  const list = read(CONVERSATIONS, []);
  return Array.isArray(list) ? list.filter((c) => c && typeof c.id === "string" && Array.isArray(c.messages)) : [];
}

export function saveConversations(list) {
  return write(CONVERSATIONS, list);
}

export function newConversation(system = "") {
  const id = crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random().toString(16).slice(2)}`;
  return { id, title: "New chat", system, messages: [], updated: Date.now() };
}

export function loadSettings() {
  const saved = read(SETTINGS, {});
  return { ...DEFAULT_SETTINGS, ...(saved && typeof saved === "object" ? saved : {}) };
}

export function saveSettings(settings) {
  return write(SETTINGS, settings);
}

export function loadKey() {
  try {
    return localStorage.getItem(KEY) || "";
  } catch {
    return "";
  }
}

export function saveKey(key) {
  try {
    localStorage.setItem(KEY, key);
  } catch {
    /* not kept: asked again next time */
  }
}

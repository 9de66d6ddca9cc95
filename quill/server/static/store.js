// Conversations and settings kept in localStorage (best effort: a full or blocked store
// only loses persistence, never the page).

const CHATS_KEY = "quill.chats.v1";
const SETTINGS_KEY = "quill.settings.v1";
const MAX_CHATS = 50;

export const DEFAULT_SYSTEM = "You are a helpful assistant.";

export const DEFAULT_SETTINGS = {
  temperature: "0.7",
  top_p: "",
  top_k: "",
  max_tokens: "256",
  seed: "",
  stop: "",
  json_schema: "",
  tools: "",
  tool_choice: "auto",
  colour_tokens: false,
  api_key: "",
};

function read(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch (_) {
    return fallback;
  }
}

function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
    return true;
  } catch (_) {
    return false;
  }
}

function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

export function newChat(system = DEFAULT_SYSTEM) {
  return { id: newId(), title: "New chat", system, messages: [], updated: Date.now() };
}

/** All chats, newest first. */
export function loadChats() {
  const chats = read(CHATS_KEY, []);
  return Array.isArray(chats) ? chats.filter((c) => c && c.id && Array.isArray(c.messages)) : [];
}

/** Save chats, newest first; drops the oldest beyond MAX_CHATS, then timelines if still too big. */
export function saveChats(chats) {
  const sorted = [...chats].sort((a, b) => b.updated - a.updated).slice(0, MAX_CHATS);
  if (write(CHATS_KEY, sorted)) return;
  const slim = sorted.map((c) => ({ ...c, messages: c.messages.map(({ tokens, ...m }) => m) }));
  write(CHATS_KEY, slim);
}

export function loadSettings() {
  return { ...DEFAULT_SETTINGS, ...read(SETTINGS_KEY, {}) };
}

export function saveSettings(settings) {
  write(SETTINGS_KEY, settings);
}

export function titleFrom(text) {
  const line = text.trim().split("\n")[0];
  return line.length > 40 ? line.slice(0, 39) + "…" : line || "New chat";
}

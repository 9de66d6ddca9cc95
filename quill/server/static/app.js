// The playground: chats, settings, streaming answers, gauges and the timeline, wired together.

import { ApiError, setApiKey, streamChat } from "./api.js";
import { fillSettingsForm, requestFields, SettingsError } from "./params.js";
import { loadChats, loadSettings, newChat, saveChats, saveSettings, titleFrom } from "./store.js";
import { renderTimeline } from "./timeline.js";
import { watchServer } from "./server.js";
import { chatListNodes, messageNode } from "./view.js";

const $ = (id) => document.getElementById(id);
const ui = {
  messages: $("messages"), timeline: $("timeline"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
  system: $("system-prompt"), chatList: $("chat-list"), settings: $("settings"), settingsError: $("settings-error"),
  gauges: $("server-gauges"), model: $("model-name"), scrim: $("scrim"),
};
const state = { chats: [], chat: null, settings: loadSettings(), model: null, live: null, frame: 0 };

// ---- persistence and chat list ----

function persist() {
  state.chat.updated = Date.now();
  saveChats(state.chats);
}

function selectChat(chat) {
  state.chat = chat;
  ui.system.value = chat.system;
  renderChatList();
  renderMessages();
  closeDrawers();
}

function startNewChat() {
  if (state.live) return;
  const chat = newChat(state.chat ? state.chat.system : undefined);
  state.chats.unshift(chat);
  saveChats(state.chats);
  selectChat(chat);
  ui.prompt.focus();
}

function deleteChat(chat) {
  if (state.live) return;
  state.chats = state.chats.filter((c) => c !== chat);
  saveChats(state.chats);
  if (state.chat === chat) selectChat(state.chats[0] || newChatSaved());
  else renderChatList();
}

function newChatSaved() {
  const chat = newChat();
  state.chats.unshift(chat);
  return chat;
}

function renderChatList() {
  const sorted = [...state.chats].sort((a, b) => b.updated - a.updated);
  ui.chatList.replaceChildren(...chatListNodes(sorted, state.chat, {
    onOpen: (chat) => !state.live && selectChat(chat),
    onDelete: deleteChat,
  }));
}

// ---- messages ----

function lastAnswer() {
  const msgs = state.chat.messages;
  for (let i = msgs.length - 1; i >= 0; i -= 1) if (msgs[i].role === "assistant") return msgs[i];
  return null;
}

function nodeFor(msg, i) {
  const last = i === state.chat.messages.length - 1 && msg.role !== "user";
  return messageNode(msg, { colourTokens: state.settings.colour_tokens, last, onRegenerate: regenerate });
}

function nearBottom() {
  const m = ui.messages;
  return m.scrollHeight - m.scrollTop - m.clientHeight < 60;
}

function renderMessages() {
  ui.messages.replaceChildren(...state.chat.messages.map(nodeFor));
  if (state.chat.messages.length === 0) {
    const empty = document.createElement("div");
    empty.className = "empty";
    empty.textContent = "Ask something. The timeline below shows how the answer was made: prefill, then one cell per token.";
    ui.messages.appendChild(empty);
  }
  ui.messages.scrollTop = ui.messages.scrollHeight;
  renderTimeline(ui.timeline, lastAnswer());
}

// Redraw the answer being streamed, at most once per frame.
function scheduleLiveRender() {
  if (state.frame) return;
  state.frame = requestAnimationFrame(() => {
    state.frame = 0;
    const live = state.live;
    if (!live) return;
    const stick = nearBottom();
    const index = state.chat.messages.indexOf(live.msg);
    const old = ui.messages.children[index];
    if (old) old.replaceWith(nodeFor(live.msg, index));
    renderTimeline(ui.timeline, live.msg);
    if (stick) ui.messages.scrollTop = ui.messages.scrollHeight;
  });
}

// ---- generation ----

function setStreaming(on) {
  ui.send.hidden = on;
  ui.stop.hidden = !on;
  document.body.dataset.streaming = on ? "1" : "0";
}

function historyForApi() {
  const messages = [];
  if (state.chat.system.trim()) messages.push({ role: "system", content: state.chat.system });
  for (const m of state.chat.messages) {
    // A stopped answer stays in the history as said so far; one stopped before any text is left out.
    if (m.role === "user" || (m.role === "assistant" && !m.pending && m.content)) messages.push({ role: m.role, content: m.content });
  }
  return messages;
}

function onChunk(msg, chunk, ms) {
  if (chunk.usage) msg.usage = chunk.usage;
  if (chunk.timings) msg.timings = chunk.timings;
  const choice = chunk.choices && chunk.choices[0];
  if (!choice) return;
  const content = (choice.delta && choice.delta.content) || "";
  const entries = (choice.logprobs && choice.logprobs.content) || [];
  const at = Math.round(ms * 10) / 10;
  // With logprobs the server sends one entry per generated token, even for a token whose
  // bytes are held back (content null), so each entry is one decode cell.
  if (entries.length) {
    msg.chunks += 1;
    entries.forEach((entry, j) => {
      const text = j === entries.length - 1 ? content : "";
      msg.tokens.push(entry.token === text ? [at, text] : [at, text, entry.token]);
    });
  } else if (content) {
    msg.chunks += 1;
    msg.tokens.push([at, content]);
  }
  msg.content += content;
  if (choice.finish_reason) msg.finish = choice.finish_reason;
  scheduleLiveRender();
}

function failAnswer(msg, err) {
  const text = err instanceof ApiError ? err.message : `unexpected error: ${err && err.message ? err.message : err}`;
  if (msg.tokens.length === 0) {
    const msgs = state.chat.messages;
    msgs[msgs.indexOf(msg)] = { role: "error", content: text };
  } else {
    msg.error = text;
    msg.finish = "error";
  }
}

async function generate() {
  let fields;
  try {
    fields = requestFields(state.settings);
  } catch (err) {
    if (!(err instanceof SettingsError)) throw err;
    state.chat.messages.push({ role: "error", content: "not sent: " + err.message });
    persist();
    renderMessages();
    return;
  }
  // reasoning_format "none": a thinking model's <think>...</think> stays in the answer this page shows
  // (its token cells and gauges follow content), rather than going to a reasoning_content it does not draw.
  const body = { model: state.model || undefined, messages: historyForApi(), ...fields, logprobs: true, reasoning_format: "none" };
  const msg = { role: "assistant", content: "", tokens: [], chunks: 0, pending: true };
  const controller = new AbortController();
  state.chat.messages.push(msg);
  state.live = { msg, controller };
  setStreaming(true);
  renderMessages();
  try {
    const { done } = await streamChat(body, controller.signal, (chunk, ms) => onChunk(msg, chunk, ms));
    if (!done && !msg.finish) msg.error = "the stream ended without [DONE]; the answer may be incomplete";
  } catch (err) {
    if (err && err.name === "AbortError") {
      msg.stopped = true;
      msg.finish = "stopped";
    } else {
      failAnswer(msg, err);
    }
  } finally {
    delete msg.pending;
    state.live = null;
    setStreaming(false);
    persist();
    renderMessages();
  }
}

function sendPrompt() {
  const text = ui.prompt.value;
  if (state.live || text.trim() === "") return;
  ui.prompt.value = "";
  if (state.chat.messages.length === 0) {
    state.chat.title = titleFrom(text);
    renderChatList();
  }
  state.chat.messages.push({ role: "user", content: text });
  persist();
  generate();
}

function regenerate() {
  if (state.live) return;
  const msgs = state.chat.messages;
  while (msgs.length && msgs[msgs.length - 1].role !== "user") msgs.pop();
  if (msgs.length) generate();
  else renderMessages();
}

// ---- settings, server, drawers ----

function onSettingsInput(event) {
  const input = event.target;
  if (!input.name) return;
  state.settings[input.name] = input.type === "checkbox" ? input.checked : input.value;
  saveSettings(state.settings);
  try {
    requestFields(state.settings);
    ui.settingsError.hidden = true;
  } catch (err) {
    ui.settingsError.textContent = err.message;
    ui.settingsError.hidden = false;
  }
  if (input.name === "colour_tokens") renderMessages();
  if (input.name === "api_key") setApiKey(input.value);
}

function closeDrawers() {
  document.body.classList.remove("show-chats", "show-settings");
  ui.scrim.hidden = true;
}

function toggleDrawer(name) {
  const open = !document.body.classList.contains(name);
  closeDrawers();
  if (open) document.body.classList.add(name);
  ui.scrim.hidden = !open;
}

function bind() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    sendPrompt();
  });
  ui.prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      sendPrompt();
    }
  });
  ui.stop.addEventListener("click", () => state.live && state.live.controller.abort());
  $("new-chat").addEventListener("click", startNewChat);
  ui.system.addEventListener("input", () => {
    state.chat.system = ui.system.value;
    persist();
  });
  ui.settings.addEventListener("input", onSettingsInput);
  ui.settings.addEventListener("submit", (e) => e.preventDefault());
  $("toggle-chats").addEventListener("click", () => toggleDrawer("show-chats"));
  $("toggle-settings").addEventListener("click", () => toggleDrawer("show-settings"));
  ui.scrim.addEventListener("click", closeDrawers);
  for (const button of document.querySelectorAll(".drawer-close")) button.addEventListener("click", closeDrawers);
  window.addEventListener("resize", () => renderTimeline(ui.timeline, state.live ? state.live.msg : lastAnswer()));
}

function init() {
  state.chats = loadChats();
  // An answer that was streaming when the page closed is incomplete, not pending.
  for (const chat of state.chats) {
    for (const m of chat.messages) if (m.pending) Object.assign(m, { pending: undefined, stopped: true, finish: "stopped" });
  }
  fillSettingsForm(ui.settings, state.settings);
  setApiKey(state.settings.api_key);
  bind();
  setStreaming(false);
  selectChat(state.chats.sort((a, b) => b.updated - a.updated)[0] || newChatSaved());
  watchServer(ui.model, ui.gauges, (id) => {
    state.model = id;
  });
}

init();

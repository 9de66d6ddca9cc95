// The playground: chats, settings, streaming answers, gauges and the timeline, wired together.

import { applyChunk, historyForApi, newAnswer, openToolCalls, settleAnswer } from "./answer.js";
import { ApiError, setApiKey, streamChat } from "./api.js";
import { fillSettingsForm, requestFields, SettingsError, showSettingsProblem } from "./params.js";
import { loadChats, loadSettings, newChat, saveChats, saveSettings, titleFrom } from "./store.js";
import { renderTimeline } from "./timeline.js";
import { watchServer } from "./server.js";
import { chatListNodes, messageNode } from "./view.js";

const $ = (id) => document.getElementById(id);
const ui = {
  messages: $("messages"), timeline: $("timeline"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
  system: $("system-prompt"), chatList: $("chat-list"), settings: $("settings"), settingsError: $("settings-error"),
  gauges: $("server-gauges"), model: $("model-name"), scrim: $("scrim"), composerError: $("composer-error"),
};
// expanded: per message object, the keys of its blocks the user opened (reasoning, tool calls).
const state = { chats: [], chat: null, settings: loadSettings(), model: null, live: null, frame: 0, expanded: new WeakMap() };

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

function expandedFor(msg) {
  if (!state.expanded.has(msg)) state.expanded.set(msg, new Set());
  return state.expanded.get(msg);
}

// `waiting`: ids of the last turn's tool calls that have no result yet.
function nodeFor(msg, i, waiting = new Set()) {
  const last = i === state.chat.messages.length - 1 && (msg.role === "assistant" || msg.role === "error");
  return messageNode(msg, {
    colourTokens: state.settings.colour_tokens, last, onRegenerate: regenerate, expanded: expandedFor(msg),
    reply: waiting.size && !state.live ? { waiting, onReply: answerToolCall } : null,
  });
}

function nearBottom() {
  const m = ui.messages;
  return m.scrollHeight - m.scrollTop - m.clientHeight < 60;
}

function renderMessages() {
  const waiting = new Set(openToolCalls(state.chat).map((call) => call.id));
  ui.messages.replaceChildren(...state.chat.messages.map((msg, i) => nodeFor(msg, i, waiting)));
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
    if (old) replaceKeepingFocus(old, nodeFor(live.msg, index));
    renderTimeline(ui.timeline, live.msg);
    if (stick) ui.messages.scrollTop = ui.messages.scrollHeight;
  });
}

// A block's summary that had the keyboard focus keeps it when its message is redrawn.
function replaceKeepingFocus(old, fresh) {
  const focused = old.contains(document.activeElement) && document.activeElement.closest("[data-key]");
  old.replaceWith(fresh);
  if (!focused) return;
  const again = fresh.querySelector(`[data-key="${focused.dataset.key}"] > summary`);
  if (again) again.focus();
}

// ---- generation ----

function setStreaming(on) {
  ui.send.hidden = on;
  ui.stop.hidden = !on;
  document.body.dataset.streaming = on ? "1" : "0";
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

// The request fields, or null after saying next to the composer why nothing is sent.
function checkedFields() {
  try {
    const fields = requestFields(state.settings);
    ui.composerError.hidden = true;
    return fields;
  } catch (err) {
    if (!(err instanceof SettingsError)) throw err;
    ui.composerError.textContent = `Not sent: ${err.message}. Fix it in the settings.`;
    ui.composerError.hidden = false;
    return null;
  }
}

// No reasoning_format: the server's default applies, which splits a thinking model's
// <think>...</think> into reasoning_content (drawn collapsed above the answer).
async function generate(fields) {
  const body = { model: state.model || undefined, messages: historyForApi(state.chat), ...fields, logprobs: true };
  const msg = newAnswer();
  const controller = new AbortController();
  state.chat.messages.push(msg);
  state.live = { msg, controller };
  setStreaming(true);
  renderMessages();
  try {
    const { done } = await streamChat(body, controller.signal, (chunk, ms) => {
      applyChunk(msg, chunk, ms);
      scheduleLiveRender();
    });
    if (!done && !msg.finish) msg.error = "the stream ended without [DONE]; the answer may be incomplete";
  } catch (err) {
    if (err && err.name === "AbortError") {
      msg.stopped = true;
      msg.finish = "stopped";
    } else {
      failAnswer(msg, err);
    }
  } finally {
    settleAnswer(msg);
    state.live = null;
    setStreaming(false);
    persist();
    renderMessages();
  }
}

function sendPrompt() {
  const text = ui.prompt.value;
  if (state.live || text.trim() === "") return;
  const fields = checkedFields();
  if (!fields) return;  // the prompt stays in the box
  ui.prompt.value = "";
  if (state.chat.messages.length === 0) {
    state.chat.title = titleFrom(text);
    renderChatList();
  }
  state.chat.messages.push({ role: "user", content: text });
  persist();
  generate(fields);
}

// The last answer again: it (and any error after it) goes; the user message or tool results before it stay.
function regenerate() {
  if (state.live) return;
  const fields = checkedFields();
  if (!fields) return;
  const msgs = state.chat.messages;
  while (msgs.length && (msgs[msgs.length - 1].role === "assistant" || msgs[msgs.length - 1].role === "error")) msgs.pop();
  if (msgs.length && openToolCalls(state.chat).length === 0) generate(fields);
  else renderMessages();
}

// A result typed for one call; once every call of the turn has one, the model continues.
function answerToolCall(call, text) {
  if (state.live) return;
  const last = openToolCalls(state.chat).length === 1;
  const fields = last ? checkedFields() : {};
  if (!fields) return;  // the typed result stays in its box
  state.chat.messages.push({ role: "tool", tool_call_id: call.id, name: call.function.name, content: text });
  persist();
  if (last) {
    generate(fields);
    return;
  }
  renderMessages();
  const next = ui.messages.querySelector(".tool-reply input");
  if (next) next.focus();
}

// ---- settings, server, drawers ----

function onSettingsInput(event) {
  const input = event.target;
  if (!input.name) return;
  state.settings[input.name] = input.type === "checkbox" ? input.checked : input.value;
  saveSettings(state.settings);
  if (!showSettingsProblem(ui.settings, ui.settingsError, state.settings)) ui.composerError.hidden = true;
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
  showSettingsProblem(ui.settings, ui.settingsError, state.settings);
  setApiKey(state.settings.api_key);
  bind();
  setStreaming(false);
  selectChat(state.chats.sort((a, b) => b.updated - a.updated)[0] || newChatSaved());
  watchServer(ui.model, ui.gauges, (id) => {
    state.model = id;
  });
}

init();

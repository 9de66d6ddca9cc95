// One assistant answer as stream chunks build it (content, reasoning, tool calls, timeline cells),
// and the conversation as the API reads it back. Plain data, no DOM.

/** A new, pending assistant message. */
export function newAnswer() {
  return { role: "assistant", content: "", reasoning: "", tool_calls: [], tokens: [], chunks: 0, thinkingCells: 0, pending: true };
}

/** The message's tool calls in index order (a stream may leave holes; saved chats hold null there). */
export function toolCalls(msg) {
  return (msg.tool_calls || []).filter(Boolean);
}

/** Tokens of reasoning: the server's count once usage came, else the cells that brought reasoning text. */
export function reasoningTokens(msg) {
  const details = msg.usage && msg.usage.completion_tokens_details;
  if (details && Number.isInteger(details.reasoning_tokens)) return details.reasoning_tokens;
  return msg.thinkingCells || 0;
}

// OpenAI streams each call as fragments keyed by `index`: the first names id, type and function
// name, the rest append to function.arguments. Returns the text the fragments added.
function addToolCallDeltas(msg, deltas) {
  if (!Array.isArray(deltas)) return "";
  let added = "";
  for (const d of deltas) {
    const index = Number.isInteger(d.index) ? d.index : 0;
    if (!msg.tool_calls[index]) msg.tool_calls[index] = { id: "", type: "function", function: { name: "", arguments: "" } };
    const call = msg.tool_calls[index];
    if (d.id) call.id = d.id;
    if (d.type) call.type = d.type;
    const fn = d.function || {};
    if (typeof fn.name === "string") call.function.name += fn.name;
    if (typeof fn.arguments === "string") call.function.arguments += fn.arguments;
    added += (fn.name || "") + (fn.arguments || "");
  }
  return added;
}

// With logprobs the server sends one entry per generated token, even for a token whose text is
// held back or is not content (reasoning, tool-call markup), so each entry is one timeline cell;
// the chunk's content goes on its last entry. A step that yields several kinds comes as several
// chunks with the entries on the last, so once entries came, a chunk without them adds no cell.
// A stream without logprobs gets one cell per chunk that brought text.
function addCells(msg, entries, at, content, other, thinking) {
  if (entries.length) {
    msg.chunks += 1;
    msg.cellsFromLogprobs = true;
    entries.forEach((entry, j) => {
      const text = j === entries.length - 1 ? content : "";
      msg.tokens.push(entry.token === text ? [at, text] : [at, text, entry.token]);
    });
    if (thinking) msg.thinkingCells += entries.length;
  } else if (!msg.cellsFromLogprobs && (content || other)) {
    msg.chunks += 1;
    msg.tokens.push(content ? [at, content] : [at, "", other]);
    if (thinking) msg.thinkingCells += 1;
  }
}

/** Fold one streamed chunk (arrived `ms` after the request was sent) into `msg`. */
export function applyChunk(msg, chunk, ms) {
  if (chunk.usage) msg.usage = chunk.usage;
  if (chunk.timings) msg.timings = chunk.timings;
  const choice = chunk.choices && chunk.choices[0];
  if (!choice) return;
  const delta = choice.delta || {};
  const content = delta.content || "";
  const reasoning = delta.reasoning_content || "";
  const callText = addToolCallDeltas(msg, delta.tool_calls);
  const entries = (choice.logprobs && choice.logprobs.content) || [];
  addCells(msg, entries, Math.round(ms * 10) / 10, content, reasoning || callText, reasoning !== "" && content === "");
  msg.content += content;
  msg.reasoning = (msg.reasoning || "") + reasoning;
  if (choice.finish_reason) msg.finish = choice.finish_reason;
}

/** The stream ended: a call the server gave no id gets one, so that a tool result can name it. */
export function settleAnswer(msg) {
  delete msg.pending;
  toolCalls(msg).forEach((call, i) => {
    if (!call.id) call.id = `call_${i}`;
  });
}

// A turn cut short (Stop, an error, max tokens) may hold a call whose arguments are half written.
function callsComplete(msg) {
  return !msg.pending && !msg.stopped && !msg.error && msg.finish !== "length";
}

function assistantForApi(msg) {
  const calls = callsComplete(msg) ? toolCalls(msg) : [];
  // A stopped answer stays in the history as said so far; one stopped before any text is left out.
  if (!msg.content && calls.length === 0) return null;
  const out = { role: "assistant", content: msg.content || null };
  // The reasoning goes back as reasoning_content, never in content: the chat template decides
  // whether the model sees it again (Qwen3's keeps it for the turn after the last user message,
  // i.e. while it is calling tools, and drops older turns'; others ignore the field).
  if (msg.reasoning) out.reasoning_content = msg.reasoning;
  if (calls.length) {
    out.tool_calls = calls.map((c) => ({ id: c.id, type: "function", function: { name: c.function.name, arguments: c.function.arguments } }));
  }
  return out;
}

/** The request's messages: the system prompt, then the chat (errors and empty answers left out). */
export function historyForApi(chat) {
  const messages = [];
  if (chat.system.trim()) messages.push({ role: "system", content: chat.system });
  for (const m of chat.messages) {
    if (m.role === "user") messages.push({ role: "user", content: m.content });
    else if (m.role === "tool") messages.push({ role: "tool", tool_call_id: m.tool_call_id, content: m.content });
    else if (m.role === "assistant" && !m.pending) {
      const out = assistantForApi(m);
      if (out) messages.push(out);
    }
  }
  return messages;
}

/** The calls of the chat's last turn still waiting for a tool result ([] once a user message follows). */
export function openToolCalls(chat) {
  const msgs = chat.messages;
  let i = msgs.length - 1;
  while (i >= 0 && msgs[i].role === "tool") i -= 1;
  const turn = msgs[i];
  if (!turn || turn.role !== "assistant" || !callsComplete(turn)) return [];
  const answered = new Set(msgs.slice(i + 1).map((m) => m.tool_call_id));
  return toolCalls(turn).filter((call) => !answered.has(call.id));
}

// An answer's collapsible parts (its reasoning, its tool calls with a reply form while a call waits
// for a result) and tool results, as DOM nodes. Model text only ever lands in text nodes.

import { reasoningTokens, toolCalls } from "./answer.js";

const PREVIEW_CHARS = 60;

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// Collapsed unless its key is in `expanded`, which the page keeps per message, so a block the
// user opened stays open while the streaming answer is redrawn.
function collapsible(className, key, expanded, summaryNodes, bodyNodes) {
  const details = el("details", className);
  details.dataset.key = key;
  details.open = expanded.has(key);
  const summary = el("summary");
  summary.append(...summaryNodes);
  details.append(summary, ...bodyNodes);
  details.addEventListener("toggle", () => (details.open ? expanded.add(key) : expanded.delete(key)));
  return details;
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

/** The reasoning, collapsed: "Thinking… (N tokens)" while it streams, then "Thought for N tokens". */
export function reasoningBlock(msg, expanded) {
  const n = reasoningTokens(msg);
  const count = n ? plural(n, "token") : "";
  const thinking = msg.pending && !msg.content && toolCalls(msg).length === 0;
  const label = thinking ? `Thinking…${count ? ` (${count})` : ""}` : count ? `Thought for ${count}` : "Thoughts";
  return collapsible("part reasoning", "reasoning", expanded, [el("span", "part-label", label)], [el("div", "reasoning-text", msg.reasoning)]);
}

/** Arguments as indented JSON when they parse (json: true), else the text as it came. */
export function prettyArguments(text) {
  try {
    return { text: JSON.stringify(JSON.parse(text), null, 2), json: true };
  } catch (_) {
    return { text, json: false };
  }
}

function preview(text) {
  let line = text;
  try {
    line = JSON.stringify(JSON.parse(text));
  } catch (_) {
    line = text.replace(/\s+/g, " ");
  }
  return line.length > PREVIEW_CHARS ? line.slice(0, PREVIEW_CHARS - 1) + "…" : line;
}

function replyForm(call, onReply) {
  const form = el("form", "tool-reply");
  const label = el("label");
  const input = el("input");
  input.type = "text";
  input.name = "tool_result";
  input.autocomplete = "off";
  input.spellcheck = false;
  input.placeholder = 'the result, e.g. {"temperature": 18}';
  label.append(el("span", "hint", `Reply with tool result for ${call.function.name || "this call"}`), input);
  const send = el("button", "btn small", "Send result");
  send.type = "submit";
  form.append(label, send);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    if (input.value.trim() !== "") onReply(call, input.value);
  });
  return form;
}

function toolCallBlock(call, i, { expanded, settled, onReply }) {
  const wrap = el("div", "tool-call");
  const args = prettyArguments(call.function.arguments);
  const summary = [el("span", "part-label", "Tool call"), el("code", "tool-name", call.function.name || "…"),
    el("span", "tool-preview", preview(call.function.arguments))];
  const code = el("pre", "code-block");
  code.appendChild(el("code", null, args.text || "(no arguments)"));
  const body = [code];
  if (settled && !args.json) body.push(el("div", "hint", "the arguments are not valid JSON; shown as sent"));
  if (call.id) body.push(el("div", "hint tool-id", "id " + call.id));
  wrap.appendChild(collapsible("part tool-call-details", "call-" + i, expanded, summary, body));
  if (onReply) wrap.appendChild(replyForm(call, onReply));
  return wrap;
}

/**
 * The message's tool calls, one collapsed block each; `reply.waiting` holds the ids of calls that
 * still wait for a result, which get a reply form calling `reply.onReply(call, text)`.
 */
export function toolCallsNode(msg, expanded, reply) {
  const list = el("div", "tool-calls");
  toolCalls(msg).forEach((call, i) => {
    const onReply = reply && reply.waiting.has(call.id) ? reply.onReply : null;
    list.appendChild(toolCallBlock(call, i, { expanded, settled: !msg.pending, onReply }));
  });
  return list;
}

/** A tool result the user gave: which call it answers, then its text. */
export function toolResultNode(msg) {
  const node = el("article", "msg tool");
  const head = el("div", "tool-result-head");
  head.append(el("span", "part-label", "Tool result"), el("code", "tool-name", msg.name || "?"), el("span", "hint", msg.tool_call_id || ""));
  node.append(head, el("div", "body plain", msg.content));
  return node;
}

// Chat messages, per-answer gauges and server gauges as DOM nodes (text via textContent only).

import { toolCalls } from "./answer.js";
import { reasoningBlock, toolCallsNode, toolResultNode } from "./blocks.js";
import { renderMarkdown } from "./md.js";
import { fmtMs, renderTokens } from "./timeline.js";

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function gauge(name, label, value, shown, title) {
  const node = el("span", "gauge");
  node.dataset.gauge = name;
  node.dataset.value = Number.isFinite(value) ? String(value) : "";
  node.appendChild(el("b", null, shown));
  node.appendChild(document.createTextNode(" " + label));
  if (title) node.title = title;
  return node;
}

/** Answer figures: the server's timings when the stream ended normally, else measured here. */
export function answerFigures(msg) {
  const tokens = msg.tokens || [];
  const n = msg.usage ? msg.usage.completion_tokens : tokens.length;
  const t = msg.timings;
  if (t) {
    return { source: "server", ttft: t.ttft_ms, tps: t.predicted_per_second, tpot: t.tpot_ms, cached: t.cache_n, computed: t.prompt_n, output: n };
  }
  const first = tokens.length ? tokens[0][0] : NaN;
  const last = tokens.length ? tokens[tokens.length - 1][0] : NaN;
  const span = last - first;
  const tps = tokens.length > 1 && span > 0 ? ((tokens.length - 1) * 1000) / span : NaN;
  const tpot = tokens.length > 1 ? span / (tokens.length - 1) : NaN;
  return { source: "browser", ttft: first, tps, tpot, cached: NaN, computed: NaN, output: n };
}

function fmtNum(v, digits = 1) {
  return Number.isFinite(v) ? v.toFixed(digits) : "–";
}

function gaugesRow(msg) {
  const f = answerFigures(msg);
  const row = el("div", "gauges answer-gauges");
  row.dataset.source = f.source;
  const src = f.source === "server" ? "measured by the server" : "measured in the browser (no server timings for this answer)";
  row.appendChild(gauge("ttft", "TTFT", f.ttft, fmtMs(f.ttft), "time to first token, " + src));
  row.appendChild(gauge("tps", "tok/s", f.tps, fmtNum(f.tps), "generation tok/s = (output tokens − 1) / (E2E − TTFT), " + src));
  row.appendChild(gauge("tpot", "TPOT", f.tpot, fmtMs(f.tpot), "time per output token after the first, " + src));
  const prompt = Number.isFinite(f.computed) ? `${f.cached} / ${f.computed}` : "–";
  row.appendChild(gauge("prompt", "cached / computed", f.computed, prompt, "prompt tokens from the prefix cache / computed"));
  row.appendChild(gauge("output", "tokens", f.output, String(f.output), "output tokens"));
  return row;
}

function statusBadge(msg) {
  if (msg.pending) return el("span", "badge live", "generating…");
  if (msg.stopped) return el("span", "badge stopped", "stopped · incomplete");
  if (msg.error) return el("span", "badge error", "error · incomplete");
  if (msg.finish === "length") return el("span", "badge", "finish: length (max tokens or context)");
  if (msg.finish) return el("span", "badge", "finish: " + msg.finish);
  return null;
}

function answerBody(msg, colourTokens) {
  const body = el("div", "body");
  if (colourTokens && msg.tokens && msg.tokens.length) renderTokens(body, msg);
  else if (msg.content) body.appendChild(renderMarkdown(msg.content));
  else if (msg.pending && !msg.reasoning && toolCalls(msg).length === 0) body.appendChild(el("span", "cursor", "▍"));
  return body;
}

/**
 * One message as a node; `last` adds the regenerate button. `expanded` (a Set) holds the keys of
 * this message's open blocks; `reply` ({waiting: Set of call ids, onReply}) lets calls be answered.
 */
export function messageNode(msg, { colourTokens, last, onRegenerate, expanded = new Set(), reply = null }) {
  if (msg.role === "tool") return toolResultNode(msg);
  const node = el("article", "msg " + msg.role);
  if (msg.role === "user") {
    node.appendChild(el("div", "body plain", msg.content));
    return node;
  }
  if (msg.role === "error") {
    node.setAttribute("role", "alert");
    node.appendChild(el("div", "body plain", msg.content));
  } else {
    if (msg.reasoning) node.appendChild(reasoningBlock(msg, expanded));
    node.appendChild(answerBody(msg, colourTokens));
    if (toolCalls(msg).length) node.appendChild(toolCallsNode(msg, expanded, reply));
    if (msg.error) node.appendChild(el("div", "inline-error", msg.error));
    if (msg.tokens && msg.tokens.length) node.appendChild(gaugesRow(msg));
  }
  const foot = el("div", "foot");
  const badge = msg.role === "assistant" ? statusBadge(msg) : null;
  if (badge) foot.appendChild(badge);
  if (last && !msg.pending) {
    foot.appendChild(button("link-btn regenerate", "↻ regenerate", onRegenerate));
  }
  if (foot.childNodes.length) node.appendChild(foot);
  return node;
}

function button(className, text, onClick) {
  const node = el("button", className, text);
  node.type = "button";
  node.addEventListener("click", onClick);
  return node;
}

/** The conversation list: one <li> per chat (open it, or delete it). */
export function chatListNodes(chats, current, { onOpen, onDelete }) {
  return chats.map((chat) => {
    const li = el("li", chat === current ? "current" : null);
    const del = button("chat-del", "×", () => onDelete(chat));
    del.setAttribute("aria-label", "delete " + chat.title);
    li.append(button("chat-open", chat.title, () => onOpen(chat)), del);
    return li;
  });
}

function pct(v) {
  return Number.isFinite(v) ? (v * 100).toFixed(0) + "%" : "–";
}

/** Fill the header's server gauges from /v1/stats (or mark them offline). */
export function renderServerGauges(container, stats, error) {
  container.replaceChildren();
  if (error || !stats) {
    container.appendChild(el("span", "gauge offline", error ? "server unreachable" : "…"));
    return;
  }
  const e = stats.engine || {};
  container.appendChild(gauge("running", "running", e.running, String(e.running ?? "–")));
  container.appendChild(gauge("waiting", "waiting", e.waiting, String(e.waiting ?? "–")));
  const kv = gauge("kv", "KV", e.kv_blocks_used, `${e.kv_blocks_used ?? "–"}/${e.kv_blocks_total ?? "–"}`,
    `KV-cache blocks held by requests / in the pool (${e.kv_blocks_cached ?? 0} more hold reusable prefixes)`);
  const bar = el("i", "bar");
  const fill = el("i", "fill");
  fill.style.width = e.kv_blocks_total ? (100 * e.kv_blocks_used) / e.kv_blocks_total + "%" : "0";
  bar.appendChild(fill);
  kv.appendChild(bar);
  container.appendChild(kv);
  container.appendChild(gauge("hit", "prefix hit", e.prefix_cache_hit_rate, pct(e.prefix_cache_hit_rate),
    "prompt tokens served from the prefix cache / prompt tokens, since the server started"));
  if (!stats.ready) container.appendChild(el("span", "gauge offline", stats.draining ? "shutting down" : "loading"));
}

// One answer's timeline (a prefill block, then one cell per generated token, width ∝ time)
// and the answer's text coloured by token boundary.

import { reasoningTokens } from "./answer.js";

const MIN_CELL_PX = 2;
const MIN_PREFILL_PX = 28;

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

/**
 * Per-token arrival times (ms since the request was sent). Tokens that came in one chunk
 * share an arrival time; spread them evenly over the gap before it, so each still gets a cell.
 */
export function tokenTimes(tokens) {
  const times = tokens.map((t) => t[0]);
  let start = 0;
  while (start < times.length) {
    let end = start;
    while (end + 1 < times.length && times[end + 1] === times[start]) end += 1;
    const count = end - start + 1;
    if (count > 1 && start > 0) {
      const before = times[start - 1];
      for (let j = 0; j < count; j += 1) times[start + j] = before + ((times[end] - before) * (j + 1)) / count;
    }
    start = end + 1;
  }
  return times;
}

function median(values) {
  if (values.length === 0) return 0;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.floor(sorted.length / 2)];
}

export function fmtMs(ms) {
  if (!Number.isFinite(ms)) return "–";
  return ms >= 1000 ? (ms / 1000).toFixed(2) + " s" : ms >= 10 ? ms.toFixed(0) + " ms" : ms.toFixed(1) + " ms";
}

function showToken(text) {
  return JSON.stringify(text ?? "");
}

function endLabel(msg) {
  if (msg.pending) return "…";
  if (msg.stopped) return "stopped";
  return msg.finish || "?";
}

function prefillTitle(msg, ttft) {
  const t = msg.timings;
  const prompt = t ? `${t.prompt_n} computed + ${t.cache_n} cached prompt tokens, prefill ${fmtMs(t.prompt_ms)} on the server, ` : "";
  return `prefill: ${prompt}first token after ${fmtMs(ttft)} (in the browser)`;
}

function buildTrack(msg, times, width) {
  const ttft = times[0];
  const gaps = times.map((t, i) => (i === 0 ? 0 : t - times[i - 1]));
  const total = times[times.length - 1] || 1;
  const pxPerMs = Math.max(width - 64, 40) / total;
  const slow = 2 * median(gaps.slice(1));
  const thinking = reasoningTokens(msg);
  const track = el("div", "tl-track");
  const prefill = el("div", "tl-prefill", "prefill");
  const prefillPx = Math.max(MIN_PREFILL_PX, ttft * pxPerMs);
  prefill.style.width = prefillPx + "px";
  if (prefillPx < 44) prefill.textContent = "";
  prefill.title = prefillTitle(msg, ttft);
  track.appendChild(prefill);
  msg.tokens.forEach((token, i) => {
    const kind = i === 0 ? "tl-cell first" : gaps[i] > slow && slow > 0 ? "tl-cell slow" : "tl-cell";
    const cell = el("div", i < thinking ? kind + " thinking" : kind);
    cell.dataset.i = String(i);
    cell.style.width = Math.max(MIN_CELL_PX, gaps[i] * pxPerMs) + "px";
    cell.title = cellText(msg, times, gaps, i) + (i < thinking ? " · thinking" : "");
    track.appendChild(cell);
  });
  track.appendChild(el("div", "tl-end end-" + endLabel(msg).replace(/\W/g, ""), endLabel(msg)));
  return track;
}

function cellText(msg, times, gaps, i) {
  const token = msg.tokens[i];
  const piece = token[2] !== undefined && token[2] !== token[1] ? ` (piece ${showToken(token[2])})` : "";
  const gap = i === 0 ? "first token, sampled by prefill" : `+${fmtMs(gaps[i])} after the previous`;
  return `#${i + 1} ${showToken(token[1])}${piece} · ${gap} · at ${fmtMs(times[i])}`;
}

function caption(msg) {
  const n = msg.tokens.length;
  const reported = msg.usage ? msg.usage.completion_tokens : null;
  let text = `${n} decode cell${n === 1 ? "" : "s"}`;
  if (reported !== null && reported !== undefined) {
    text += reported === n ? ` = ${reported} generated tokens` : ` but the server reports ${reported} tokens (chunks ≠ tokens)`;
  }
  if (msg.chunks !== undefined && msg.chunks !== n) text += ` · ${msg.chunks} chunks`;
  return text + " · hover or tap a cell";
}

/** Draw `msg`'s timeline into `container` (replacing what was there). */
export function renderTimeline(container, msg) {
  container.replaceChildren();
  if (!msg || !msg.tokens || msg.tokens.length === 0) {
    container.appendChild(el("div", "tl-empty", msg && msg.pending ? "waiting for the first token…" : "no answer yet"));
    container.dataset.cells = "0";
    return;
  }
  const times = tokenTimes(msg.tokens);
  const strip = el("div", "tl-strip");
  container.appendChild(strip);
  strip.appendChild(buildTrack(msg, times, strip.clientWidth || 300));
  const readout = el("div", "tl-readout", caption(msg));
  container.appendChild(readout);
  container.dataset.cells = String(msg.tokens.length);
  const show = (event) => {
    const cell = event.target.closest(".tl-cell, .tl-prefill");
    if (cell) readout.textContent = cell.title;
  };
  strip.addEventListener("pointerover", show);
  strip.addEventListener("click", show);
}

/** The answer as plain text, one span per token, alternating colours. */
export function renderTokens(parent, msg) {
  const wrap = el("div", "tokens");
  msg.tokens.forEach((token, i) => {
    if (!token[1]) return;
    const span = el("span", "tok tok-" + (i % 4), token[1]);
    span.title = `#${i + 1} at ${fmtMs(token[0])}`;
    wrap.appendChild(span);
  });
  parent.appendChild(wrap);
}

// Minimal, safe markdown: builds DOM nodes with textContent only, never parses HTML.
// Supports paragraphs, headings, code fences (also unterminated, while streaming), inline
// code, **bold**, *italic* / _italic_, bullet and numbered lists, and http(s) links.

const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

// Safe link targets only: anything else (javascript:, data:, relative) stays plain text.
export function safeHref(url) {
  return /^https?:\/\/[^\s]+$/i.test(url) ? url : null;
}

// Inline patterns, tried at each position; the earliest match wins.
const INLINE = [
  { kind: "code", re: /`([^`\n]+)`/ },
  { kind: "link", re: /\[([^\]\n]+)\]\(([^)\s]+)\)/ },
  { kind: "bold", re: /\*\*([^*\s][^\n]*?)\*\*|(?<![\w])__([^_\s][^\n]*?)__(?![\w])/ },
  { kind: "italic", re: /\*([^*\s][^*\n]*?)\*|(?<![\w])_([^_\s][^_\n]*?)_(?![\w])/ },
  { kind: "url", re: /https?:\/\/[^\s<>()\[\]]+[^\s<>()\[\].,;:!?'"]/ },
];

function earliestMatch(text) {
  let best = null;
  for (const { kind, re } of INLINE) {
    const m = re.exec(text);
    if (m && (best === null || m.index < best.m.index)) best = { kind, m };
  }
  return best;
}

export function renderInline(text, parent) {
  let rest = text;
  while (rest.length > 0) {
    const found = earliestMatch(rest);
    if (found === null) {
      parent.appendChild(document.createTextNode(rest));
      return;
    }
    const { kind, m } = found;
    if (m.index > 0) parent.appendChild(document.createTextNode(rest.slice(0, m.index)));
    appendInline(kind, m, parent);
    rest = rest.slice(m.index + m[0].length);
  }
}

function appendInline(kind, m, parent) {
  if (kind === "code") {
    const code = el("code");
    code.textContent = m[1];
    parent.appendChild(code);
  } else if (kind === "link" || kind === "url") {
    const href = safeHref(kind === "link" ? m[2] : m[0]);
    if (href === null) {
      parent.appendChild(document.createTextNode(m[0]));
      return;
    }
    const a = el("a");
    a.href = href;
    a.target = "_blank";
    a.rel = "noopener noreferrer nofollow";
    if (kind === "link") renderInline(m[1], a);
    else a.textContent = m[0];
    parent.appendChild(a);
  } else {
    const node = el(kind === "bold" ? "strong" : "em");
    renderInline(m[1] ?? m[2], node);
    parent.appendChild(node);
  }
}

function appendLines(lines, parent) {
  lines.forEach((line, i) => {
    if (i > 0) parent.appendChild(el("br"));
    renderInline(line, parent);
  });
}

function codeBlock(lang, lines, open) {
  const pre = el("pre", open ? "code-block open" : "code-block");
  const code = el("code");
  if (lang) {
    pre.dataset.lang = lang;
    code.className = "lang-" + lang.replace(/[^\w-]/g, "");
  }
  code.textContent = lines.join("\n");
  pre.appendChild(code);
  return pre;
}

// Collect list items starting at `start`; returns [list element, next line index].
function listBlock(lines, start, ordered) {
  const pattern = ordered ? NUMBERED : BULLET;
  const list = el(ordered ? "ol" : "ul");
  if (ordered) list.start = parseInt(pattern.exec(lines[start])[1], 10);
  let i = start;
  let item = null;
  while (i < lines.length) {
    const m = pattern.exec(lines[i]);
    if (m) {
      item = el("li");
      renderInline(ordered ? m[2] : m[1], item);
      list.appendChild(item);
    } else if (item && /^\s{2,}\S/.test(lines[i])) {
      item.appendChild(el("br"));
      renderInline(lines[i].trim(), item);
    } else {
      break;
    }
    i += 1;
  }
  return [list, i];
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || BULLET.test(line) || NUMBERED.test(line);
}

/** Markdown text -> DocumentFragment. Model text only ever lands in text nodes. */
export function renderMarkdown(text) {
  const frag = document.createDocumentFragment();
  const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      const open = i >= lines.length;
      frag.appendChild(codeBlock(fence[2], body, open));
      i += 1;
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      const h = el("h" + Math.min(heading[1].length + 2, 6));
      renderInline(heading[2], h);
      frag.appendChild(h);
      i += 1;
      continue;
    }
    if (BULLET.test(line) || NUMBERED.test(line)) {
      const [list, next] = listBlock(lines, i, !BULLET.test(line));
      frag.appendChild(list);
      i = next;
      continue;
    }
    if (line.trim() === "") {
      i += 1;
      continue;
    }
    const para = [];
    while (i < lines.length && lines[i].trim() !== "" && (para.length === 0 || !startsBlock(lines[i]))) {
      para.push(lines[i++]);
    }
    const p = el("p");
    appendLines(para, p);
    frag.appendChild(p);
  }
  return frag;
}

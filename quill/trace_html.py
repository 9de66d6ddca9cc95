"""A self-contained HTML timeline of a Trace: a wide prefill block, then one cell per decode step."""

from __future__ import annotations

import html
import json

_STYLE = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222}
.row{display:flex;align-items:stretch;gap:2px;overflow-x:auto;padding:8px 0}
.cell{padding:6px 4px;border-radius:4px;min-width:18px;font-family:ui-monospace,monospace;white-space:pre;cursor:default}
.prefill{background:#6b8fd6;color:#fff}.decode{color:#111}.stop{background:#444;color:#fff}
.tokens span{padding:1px 2px;margin:1px;border-radius:3px;font-family:ui-monospace,monospace;white-space:pre}
#detail{margin-top:12px;padding:8px;background:#f4f4f4;border-radius:4px;min-height:3em;white-space:pre-wrap}
"""


def _hue(i: int) -> str:
    return f"hsl({(i * 47) % 360},70%,82%)"


def _detail(s) -> str:
    top = "\n".join(f"  {piece!r}  p={p:.3f}" for _, piece, p in s.top)
    lines = [f"step {s.index} ({s.kind}), {s.ms:.2f} ms",
             f"positions {s.positions[0]}..{s.positions[1] - 1}, attention over {s.kv_positions} KV positions"]
    if s.cached_positions:
        lines.append(f"{s.cached_positions} positions from the prefix cache")
    if s.input_token:
        lines.append(f"input token {s.input_token[1]!r} gets its K/V in this step")
    if s.token_id is not None:
        lines.append(f"sampled {s.piece!r} (id {s.token_id}); top-3:\n{top}")
    return "\n".join(lines)


def render_html(t) -> str:
    total_ms = sum(s.ms for s in t.steps) or 1.0
    cells = []
    for s in t.steps:
        width = max(18, int(600 * s.ms / total_ms)) if s.kind == "prefill" else max(18, int(300 * s.ms / total_ms))
        cls = "prefill" if s.kind == "prefill" else "decode"
        style = f"flex:0 0 {width}px" + ("" if s.kind == "prefill" else f";background:{_hue(s.index)}")
        label = "prefill" if s.kind == "prefill" else (s.piece or "·")
        cells.append(f'<div class="cell {cls}" style="{style}" data-detail="{html.escape(json.dumps(_detail(s)))}">'
                     f"{html.escape(label)}</div>")
    cells.append(f'<div class="cell stop" data-detail="{html.escape(json.dumps(t.stop))}">{html.escape(t.finish_reason)}</div>')
    answer = "".join(f'<span style="background:{_hue(s.index)}" title="step {s.index}, {s.ms:.1f} ms">'
                     f"{html.escape(s.piece)}</span>" for s in t.steps if s.token_id is not None)
    prompt = "".join(f'<span style="background:#e6e6e6" title="id {i}">{html.escape(p)}</span>' for i, p in t.prompt_tokens)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>quill trace</title><style>{_STYLE}</style></head>
<body><h2>quill trace</h2>
<p>{len(t.prompt_tokens)} prompt tokens, {len(t.steps)} steps, {total_ms:.1f} ms; stop: {html.escape(t.stop)};
release: {t.blocks_freed} blocks freed, {t.blocks_cached} kept in the prefix cache.</p>
<h3>Prompt tokens</h3><div class="tokens">{prompt}</div>
<h3>Steps (width ∝ time; hover for details)</h3><div class="row">{''.join(cells)}</div>
<div id="detail">hover a step</div>
<h3>Answer, coloured by step</h3><div class="tokens">{answer}</div>
<script>
for (const el of document.querySelectorAll('[data-detail]')) {{
  el.addEventListener('mouseenter', () => {{ document.getElementById('detail').textContent = JSON.parse(el.dataset.detail); }});
}}
</script></body></html>"""

"""Walk one request through the engine step by step and record what each step did."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from quill.sampling_params import SamplingParams


@dataclass
class TraceStep:
    """One engine step as seen by the traced request."""

    index: int
    kind: str  # "prefill" | "decode"
    positions: tuple[int, int]  # [start, end) computed in this step's forward
    cached_positions: int  # served from the prefix cache (first prefill step only)
    kv_positions: int  # K/V positions this step's attention covers
    ms: float
    token_id: int | None = None  # sampled at the end of the step (None: a prefill chunk that does not finish)
    piece: str = ""
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (id, piece, probability)
    input_token: tuple[int, str] | None = None  # decode: the token whose K/V this forward writes
    proposed: list[tuple[int, str]] = field(default_factory=list)  # speculative tokens verified after the input
    accepted: int = 0  # of those, kept: they and the step's own pick are this step's output
    tokens: list[tuple[int, str]] = field(default_factory=list)  # every token this step output, in order


@dataclass
class Trace:
    """Everything `quill trace` prints or renders."""

    prompt: str
    prompt_tokens: list[tuple[int, str]]
    queue_ms: float
    tokenize_ms: float
    steps: list[TraceStep]
    stop: str
    finish_reason: str
    text: str
    blocks_freed: int
    blocks_cached: int
    block_size: int


def _top(logits: torch.Tensor, tokenizer, k: int = 3) -> list[tuple[int, str, float]]:
    probs = torch.softmax(logits.float(), dim=-1)
    values, ids = probs.topk(k)
    return [(int(i), tokenizer.id_to_piece(int(i)), float(p)) for p, i in zip(values, ids)]


def trace_request(llm, prompt: str, params: SamplingParams, chat: bool = False) -> Trace:
    """Run one request alone through llm.engine, one step at a time."""
    engine, tok = llm.engine, llm.tokenizer
    t0 = time.perf_counter()
    messages = [{"role": "user", "content": prompt}]
    ids = tok.encode_chat(messages) if chat else tok.encode(prompt)
    tokenize_ms = (time.perf_counter() - t0) * 1000
    rid = "trace"
    engine.add_request(rid, ids, params, prompt=prompt)
    seq = engine.requests[rid].seqs[0]
    engine.runner.keep_logits = True
    steps: list[TraceStep] = []
    table: list[int] = []
    try:
        final = None
        while final is None:
            before = seq.num_computed_tokens
            num_out = seq.num_output_tokens
            table = list(seq.block_table) or table
            outs = engine.step()
            table = list(seq.block_table) or table  # empty once the finishing step freed it
            steps.append(_record(engine, tok, seq, len(steps), before, seq.num_computed_tokens, num_out))
            final = next((o for o in outs if o.request_id == rid and o.finished), None)
    finally:
        engine.runner.keep_logits = False
    c = final.outputs[0]
    held = -(-seq.num_computed_tokens // engine.block_manager.block_size)
    cached = sum(1 for b in table if engine.block_manager.is_cached(b))
    return Trace(
        prompt=prompt, prompt_tokens=[(i, tok.id_to_piece(i)) for i in ids],
        queue_ms=(seq.metrics.queue_time or 0.0) * 1000, tokenize_ms=tokenize_ms, steps=steps,
        stop=_stop_condition(seq, c, engine), finish_reason=c.finish_reason, text=c.text,
        blocks_freed=max(held, len(table)) - cached, blocks_cached=cached, block_size=engine.block_manager.block_size,
    )


def _record(engine, tok, seq, index: int, before: int, after: int, num_out_before: int) -> TraceStep:
    sampled = seq.num_output_tokens > num_out_before
    if index == 0:
        before = max(before, seq.num_cached_tokens)  # the prefix-cache hit is found when first scheduled
    kind = "decode" if num_out_before > 0 else "prefill"
    step = TraceStep(
        index=index, kind=kind, positions=(before, after),
        cached_positions=seq.num_cached_tokens if index == 0 else 0,
        kv_positions=after, ms=engine.last_step.seconds * 1000,
    )
    if kind == "decode":
        t = seq.output_token_ids[num_out_before - 1]
        step.input_token = (t, tok.id_to_piece(t))
    run = next(((ids, n) for rid, ids, n in engine.last_step.verified if rid == seq.request_id), None)
    if run is not None:
        step.proposed = [(t, tok.id_to_piece(t)) for t in run[0]]
        step.accepted = run[1]
    if sampled:
        new = list(seq.output_token_ids[num_out_before:])
        step.tokens = [(t, tok.id_to_piece(t)) for t in new]
        step.token_id = new[-1]
        step.piece = tok.id_to_piece(step.token_id)
        if engine.runner.last_logits is not None:  # the row that picked the step's last token
            step.top = _top(engine.runner.last_logits[len(new) - 1], tok)
    return step


def _stop_condition(seq, c, engine) -> str:
    p = seq.params
    if c.finish_reason == "length":
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return f"max_tokens ({p.max_tokens}) reached"
        return f"context limit ({engine.max_model_len} tokens) reached"
    if isinstance(c.stop_reason, str):
        return f"stop string {c.stop_reason!r} matched (removed from the text)"
    if isinstance(c.stop_reason, int):
        return f"stop token id {c.stop_reason} ({engine.tokenizer.id_to_piece(c.stop_reason)!r})"
    last = seq.output_token_ids[-1] if seq.output_token_ids else None
    return f"EOS token {last} ({engine.tokenizer.id_to_piece(last)!r})" if last is not None else "stopped"

"""The one place Sequences meet tensors: SchedulerOutput -> input ids, positions, slots -> forward -> tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from quill.config import ModelConfig
from quill.engine.block_tables import BlockTableArrays, stack_tables
from quill.engine.kv_cache import KVCache
from quill.engine.sampler import Sampler, SamplerOutput, SamplingRow
from quill.engine.faults import FaultPlan
from quill.engine.scheduler import RowKind, SchedulerOutput, ScheduledSeq
from quill.engine.sequence import Sequence
from quill.kernels.attention import AttentionMetadata, PrefillSpan


@dataclass
class StepResult:
    """Sampled tokens for the scheduled sequences that reached the end of their known tokens, and
    the sequences whose own part of the step failed (the rest of the batch is unaffected)."""

    sampled: list[tuple[Sequence, int, dict | None]]  # (seq, token id, logprobs entry); a VERIFY row's in order
    failed: list[tuple[Sequence, str, Exception]] = field(default_factory=list)  # (seq, phase, error)
    verified: list[tuple[Sequence, int, int]] = field(default_factory=list)  # VERIFY rows: (seq, proposed, accepted)


class ModelRunner:
    """Builds flat batches over the paged cache and runs the model and the sampler."""

    def __init__(self, model, model_config: ModelConfig, kv_cache: KVCache, sampler: Sampler, device="cpu",
                 faults: FaultPlan | None = None):
        self.model = model
        self.faults = faults if faults is not None else FaultPlan()
        self.config = model_config
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = torch.device(device)
        self.block_size = kv_cache.block_size
        # the distinct sliding windows of the model's layers: the torch path gets a mask for each
        self.windows = sorted({w for i in range(model_config.num_layers) if (w := model_config.layer_window(i))})
        self._generators: dict[int, torch.Generator] = {}
        self.block_tables = BlockTableArrays()  # decode rows' tables, kept between steps (fused path, a draft's)
        self.guided = None  # quill.engine.guided.MaskWorker, set by the engine when constraints are used
        self.last_logits: torch.Tensor | None = None  # (B, V) kept only when keep_logits is set (trace)
        self.keep_logits = False
        # time inside the model (layers incl. batch building, and the LM head); the rest of a step is overhead
        self.kernel_seconds = {"layers": 0.0, "lm_head": 0.0}
        from quill.kernels.fused_decode import FusedDecoder

        fused = FusedDecoder(model, kv_cache.layers) if self.device.type == "cpu" else None
        self.fused = fused if fused is not None and fused.available else None
        self.fused_refusal = None if self.fused is not None else (
            getattr(fused, "refusal", None) if fused is not None else f"device {self.device.type} has no fused kernel")

    # ---- batch construction -------------------------------------------------------------
    def _slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        positions = np.arange(start, end)
        table = np.asarray(seq.block_table, dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _mask(self, q_positions: np.ndarray, ctx: int, window: int | None = None) -> torch.Tensor:
        """(q, ctx) bool: causal, and within the sliding window if one is given."""
        keys = np.arange(ctx)[None, :]
        q = q_positions[:, None]
        allowed = keys <= q
        if window:
            allowed &= q - keys < window
        return torch.from_numpy(allowed).to(self.device)

    def prepare(self, scheduled: list[ScheduledSeq]):
        """-> input_ids (T,), positions (T,), AttentionMetadata, sample row indices."""
        ids, pos, slots, sample_rows = [], [], [], []
        prefills, decode_rows, decode_ctx = [], [], []
        row = 0
        for item in scheduled:
            seq, start, n = item.seq, item.start, item.num_new_tokens
            end = start + n
            ids.extend(seq.token_ids_slice(start, end))
            pos.append(np.arange(start, end))
            slots.append(self._slots(seq, start, end))
            if item.kind is RowKind.DECODE:
                decode_rows.append(row)
                decode_ctx.append(self._slots(seq, 0, end))
            else:
                ctx_slots = torch.from_numpy(self._slots(seq, 0, end)).to(self.device)
                q_pos = np.arange(start, end)
                mask = None if start == 0 else self._mask(q_pos, end)  # None: plain causal
                windowed = {w: None if start == 0 and end <= w else self._mask(q_pos, end, w) for w in self.windows}
                prefills.append(PrefillSpan(row, n, ctx_slots, mask, windowed))
            row += n
            if item.samples:
                sample_rows.append(row - 1)
        meta = AttentionMetadata(slot_mapping=torch.from_numpy(np.concatenate(slots)).to(self.device), prefills=prefills,
                                 gemv_rows=SchedulerOutput(scheduled).num_leading_decodes)
        if decode_rows:
            self._decode_meta(meta, decode_rows, decode_ctx, np.concatenate(pos)[decode_rows])
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.from_numpy(np.concatenate(pos)).to(self.device)
        return input_ids, positions, meta, sample_rows

    def _decode_meta(self, meta: AttentionMetadata, rows: list[int], ctx: list[np.ndarray], q_pos: np.ndarray):
        slots, lengths = _pad_slots(ctx)
        keys = np.arange(slots.shape[1])[None, :]
        allowed = keys < lengths[:, None]
        meta.decode_rows = torch.tensor(rows, dtype=torch.long, device=self.device)
        meta.decode_slots = torch.from_numpy(slots).to(self.device)
        meta.decode_mask = torch.from_numpy(allowed).to(self.device)[:, None, None, :]
        for w in self.windows:
            inside = allowed & (q_pos[:, None] - keys < w)
            meta.decode_window_masks[w] = torch.from_numpy(inside).to(self.device)[:, None, None, :]

    # ---- execution ------------------------------------------------------------------------
    def generator_for(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None:
            return None
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed((seq.params.seed * 1_000_003 + seq.index) & 0x7FFF_FFFF_FFFF_FFFF)
            self._generators[seq.seq_id] = gen
        return gen

    def release(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)
        self.block_tables.release(seq.seq_id)

    def _fused_inputs(self, items: list[ScheduledSeq]):
        """Decode-path items -> FusedDecoder.forward's arguments: ids, positions, block tables
        (R, max_blocks) int32, context lengths, block size, longest context. A DECODE item is one
        row; a VERIFY item of n tokens is n rows of the same sequence at consecutive positions, each
        attending to the positions before it (the kernel writes every row's K/V before any row
        attends), so each row's numbers are those a one-token decode at that position gives.
        O(rows) Python work: each sequence's table array is kept between steps and only its new
        blocks are copied; the kernel finds every slot from the tables."""
        tables, ids, positions = [], [], []
        for item in items:
            n, seq = item.num_new_tokens, item.seq
            tables += [self.block_tables.get(seq)] * n
            ids.append(seq.last_token_id)  # a decode row's one token is its sequence's last
            ids += seq.draft_token_ids[: n - 1]
            positions += range(item.start, item.start + n)
        return (torch.tensor(ids), torch.tensor(positions, dtype=torch.long), torch.from_numpy(stack_tables(tables)),
                torch.tensor([p + 1 for p in positions], dtype=torch.long), self.block_size, max(positions) + 1)

    def forget_block_table(self, seq: Sequence) -> None:
        """seq's block table shrank (rejected proposals' blocks freed): rebuild its array next step."""
        self.block_tables.release(seq.seq_id)

    def forward(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[int]]:
        """-> hidden (T, H) for every scheduled row, and the rows whose logits pick a token
        (in order: every row of a decode-path item, the last row of a prefill item that samples).

        Decode-path items (DECODE, VERIFY) lead the batch; with the fused kernel they run apart from
        the prefill rows, so their arithmetic never depends on what else shares the step."""
        if self.faults:
            for item in scheduled:
                self.faults.check("forward", item.seq.request_id)
        num_fused = SchedulerOutput(scheduled).num_leading_decodes if self.fused is not None else 0
        if self.fused is None and any(item.kind is RowKind.VERIFY for item in scheduled):
            raise RuntimeError("VERIFY rows need the fused decode path, which this model does not have")
        fused_rows = sum(item.num_new_tokens for item in scheduled[:num_fused])
        parts, sample_rows = [], list(range(fused_rows))  # every decode-path row samples
        if num_fused:
            parts.append(self.fused.forward(*self._fused_inputs(scheduled[:num_fused])))
        if len(scheduled) > num_fused:
            input_ids, positions, meta, rows = self.prepare(scheduled[num_fused:])
            parts.append(self.model(input_ids, positions, self.kv_cache.layers, meta))
            sample_rows += [fused_rows + r for r in rows]
        hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
        return hidden, sample_rows

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Forward the batch, then sample each sampling row. A failure of the forward raises (the
        engine decides what to retry); a failure in one row's sampling fails that row alone.

        A VERIFY item's rows are sampled as decode would sample them one step at a time: row j sees
        the output so far plus the first j proposed tokens (penalties, min_tokens, its grammar mask),
        a seeded row draws from the request's generator only if every row before it drew its proposed
        token, and the run stops at the first row that did not. So a seeded request consumes its
        random numbers exactly as without speculation, and its tokens are the same."""
        slots = [(item, j) for item in out.scheduled for j in range(item.num_sampled_rows)]  # logits row order
        sampling = [item.seq for item, _ in slots]
        if self.guided is not None:
            self.guided.submit(sampling)  # masks for this step's rows (along proposals), computed during the forward
        t0 = time.perf_counter()
        try:
            hidden, sample_rows = self.forward(out.scheduled)  # (T, H)
        except BaseException:
            if self.guided is not None:
                self.guided.discard()
            raise
        t1 = time.perf_counter()
        self.kernel_seconds["layers"] += t1 - t0
        if not sampling:
            return StepResult([])
        if len(sample_rows) != len(sampling):  # the one row-kind definition makes this impossible
            raise RuntimeError(f"{len(sample_rows)} sampling rows for {len(sampling)} sampling sequences")
        logits = self.model.compute_logits(hidden[sample_rows])  # (B, V)
        self.kernel_seconds["lm_head"] += time.perf_counter() - t1
        failed: dict[int, tuple[str, Exception]] = {}
        if self.guided is not None:
            for i, exc in self.guided.apply(logits, sampling).items():
                failed[i] = ("grammar", exc)
        if self.keep_logits:
            self.last_logits = logits.clone()
        rows: dict[int, SamplingRow] = {}
        for i, (item, j) in enumerate(slots):
            if i in failed:
                continue
            s = item.seq
            try:
                if self.faults:
                    self.faults.check("sample", s.request_id)
                history = s.output_token_ids if j == 0 else [*s.output_token_ids, *s.draft_token_ids[:j]]
                follows = (rows.get(i - 1), s.draft_token_ids[j - 1]) if j else None
                rows[i] = SamplingRow(s.params, s.prompt_token_ids, history, self.generator_for(s),
                                      constrained=self.guided is not None and self.guided.has_matcher(s),
                                      follows=follows)
            except Exception as exc:  # noqa: BLE001 - this row's failure alone
                failed[i] = ("sample", exc)
        keep = list(rows)
        picks: dict[int, tuple[int, dict | None]] = {}
        if keep:
            result = self._sample(logits if len(keep) == len(sampling) else logits[keep], list(rows.values()))
            for j, i in enumerate(keep):
                if j in result.errors:
                    failed[i] = ("sample", result.errors[j])
                else:
                    picks[i] = (result.token_ids[j], result.logprobs[j])
        return _walk(slots, picks, failed)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]):
        """The sampler over the batch; if it raises as a whole (a bug, not one row's problem),
        each row is sampled alone so that the failure stays with the rows that cause it."""
        try:
            return self.sampler(logits, rows)
        except Exception:  # noqa: BLE001
            token_ids, logprobs, errors = [], [], {}
            for j, row in enumerate(rows):
                try:
                    one = self.sampler(logits[j : j + 1], [row])
                    token_ids.append(one.token_ids[0])
                    logprobs.append(one.logprobs[0])
                    if 0 in one.errors:
                        errors[j] = one.errors[0]
                except Exception as exc:  # noqa: BLE001
                    token_ids.append(-1)
                    logprobs.append(None)
                    errors[j] = exc
            return SamplerOutput(token_ids, logprobs, errors)


def _walk(slots: list[tuple[ScheduledSeq, int]], picks: dict, failed: dict) -> StepResult:
    """Rows' picks -> each sequence's tokens. A VERIFY item keeps its rows' tokens up to and including
    the first that is not the proposed token at that position (the pick the sequence would have made
    there without speculation); rows after it were never reached and are ignored, failures included."""
    result = StepResult([])
    i = 0
    while i < len(slots):
        item = slots[i][0]
        n = item.num_sampled_rows
        tokens, error = [], None
        for j in range(n):
            if i + j in failed:
                error = failed[i + j]
                break
            token, logprobs = picks[i + j]
            tokens.append((item.seq, token, logprobs))
            if j == n - 1 or token != item.seq.draft_token_ids[j]:
                break
        if error is not None:
            result.failed.append((item.seq, *error))
        else:
            result.sampled += tokens
            if item.kind is RowKind.VERIFY:
                result.verified.append((item.seq, n - 1, len(tokens) - 1))
        i += n
    return result


def _pad_slots(ctx: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-sequence context slots -> (B, Lmax) int64 padded with each row's last real slot (so a
    padded read never touches garbage), and the (B,) int64 lengths. The torch decode path's (the
    fallback); the fused path takes block tables instead."""
    lengths = np.array([len(c) for c in ctx], dtype=np.int64)
    padded = np.empty((len(ctx), int(lengths.max())), dtype=np.int64)
    for i, c in enumerate(ctx):
        padded[i, : len(c)] = c
        padded[i, len(c) :] = c[-1]
    return padded, lengths

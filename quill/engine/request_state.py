"""One request's text-side state: detokenizers, stream holdback, matchers, and its outputs."""

from __future__ import annotations

from quill.detokenizer import IncrementalDetokenizer
from quill.engine.sequence import PrefixView, Sequence
from quill.engine.stop_checker import StreamingText
from quill.outputs import CompletionOutput, RequestOutput


class RequestState:
    """The n completions of one request and what has been streamed of each."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 seqs: list[Sequence], tokenizer):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.seqs = seqs
        params = seqs[0].params
        self.detoks = [IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens) for _ in seqs]
        self.streams = [StreamingText.for_params(params) for _ in seqs]
        self.final_text: dict[int, str] = {}
        self.num_new_chars = [0] * len(seqs)
        self.matchers: dict[int, object] = {}
        self.aborted = False
        self.error: str | None = None  # why the request failed inside the engine, if it did

    def attach_matchers(self, compiler) -> None:
        for seq in self.seqs:
            matcher = compiler.new_matcher(seq.params)
            if matcher is not None:
                self.matchers[seq.index] = matcher

    def detokenize(self, seq: Sequence, token_id: int) -> str:
        """Feed the new token; returns the whole output text so far."""
        detok = self.detoks[seq.index]
        piece = detok.add(token_id)
        self.num_new_chars[seq.index] = len(piece)
        return detok.text

    def flush(self, seq: Sequence) -> str:
        return self.detoks[seq.index].flush()

    def new_chars(self, seq: Sequence) -> int:
        return self.num_new_chars[seq.index]

    def set_final_text(self, seq: Sequence, text: str) -> None:
        self.final_text[seq.index] = text

    def text_of(self, seq: Sequence) -> str:
        return self.final_text.get(seq.index, self.detoks[seq.index].text)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def make_output(self) -> RequestOutput:
        outs = []
        for seq in self.seqs:
            text = self.text_of(seq)
            delta = self.streams[seq.index].delta(text, seq.is_finished)
            metrics = {}
            # While running, ids and logprobs are views (O(1) per step); finished, they are copied once.
            token_ids, logprobs = seq.output_token_ids, PrefixView(seq.output_logprobs)
            if seq.is_finished:
                metrics = seq.metrics.as_dict()
                metrics["itl_ms"] = [round(x * 1000.0, 3) for x in seq.metrics.itl]
                token_ids, logprobs = list(token_ids), list(logprobs)
            outs.append(CompletionOutput(
                index=seq.index,
                text=text,
                token_ids=token_ids,
                finish_reason=seq.status.finish_reason,
                delta_text=delta,
                stop_reason=seq.stop_reason,
                logprobs=logprobs if seq.params.logprobs is not None else None,
                metrics=metrics,
            ))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished,
                             num_cached_tokens=self.seqs[0].num_cached_tokens, error=self.error)

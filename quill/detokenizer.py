"""Incremental detokenizer: token ids in, stable text deltas out, never half a UTF-8 character."""

from __future__ import annotations

from quill.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt ids kept as left context, so decoders that treat a sequence's first token specially
# (SentencePiece strips its leading space) see the output as a continuation.
_PROMPT_CONTEXT = 4


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas whose concatenation is the final text.

    Only a window of recent ids is decoded per token (O(window), not O(output)):

        ids:  ... | done ... | prefix_offset ... | read_offset ... | newest
                             └ already emitted ┘ └ not yet emitted ┘

    Text is emitted once decode(ids[prefix_offset:]) grows past decode(ids[prefix_offset:read_offset])
    and does not end in U+FFFD (an incomplete multi-byte character); then both offsets move up.
    For byte-level tokenizers the deltas concatenate to tokenizer.decode(output ids) exactly.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids or [])[-_PROMPT_CONTEXT:]
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []  # a prompt ending mid-character would shift the text we slice off
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)
        self.output_token_ids: list[int] = []
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the newly stable text ("" while held back)."""
        self._ids.append(token_id)
        self.output_token_ids.append(token_id)
        window_text = self._decode(self._ids[self._prefix_offset:])
        if len(window_text) < len(self._prefix_text) or window_text.endswith(_REPLACEMENT):
            return ""
        return self._emit(window_text)

    def flush(self) -> str:
        """Text held back at the end of generation (e.g. a final partial character, as U+FFFD)."""
        return self._emit(self._decode(self._ids[self._prefix_offset:]))

    def _emit(self, window_text: str) -> str:
        delta = window_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:])
        self._trim()
        self.text += delta
        return delta

    def _trim(self) -> None:
        # Ids before prefix_offset are never decoded again; drop them so memory stays bounded.
        if self._prefix_offset:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

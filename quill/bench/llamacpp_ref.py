"""The same prefill/decode figures from llama.cpp (llama-cpp-python's low-level API) on the same GGUF."""

from __future__ import annotations

import statistics
import time


class LlamaCppRunner:
    """One llama.cpp context with room for `max_seqs` sequences of `max_ctx` tokens."""

    def __init__(self, model_path: str, threads: int, max_seqs: int = 16, max_ctx: int = 2304):
        try:
            import llama_cpp as L
        except ImportError as e:
            raise RuntimeError("--vs llama.cpp needs llama-cpp-python: pip install 'quill[bench]' "
                               "(it compiles for ~15 minutes)") from e
        self.L = L
        self._silence = L.llama_log_callback(lambda level, text, user: None)  # keep a reference
        L.llama_log_set(self._silence, None)
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(model_path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        cparams = L.llama_context_default_params()
        cparams.n_ctx = max_seqs * max_ctx
        cparams.n_batch = 2048
        cparams.n_ubatch = 512
        cparams.n_seq_max = max_seqs
        cparams.kv_unified = True  # one shared pool, so a single sequence may use more than n_ctx / n_seq_max
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cparams)
        self.batch = L.llama_batch_init(2048, 0, max_seqs)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def _clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants_logits)."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with {rc}")

    def _prefill(self, tokens: list[int], seq: int) -> None:
        for start in range(0, len(tokens), 2048):
            chunk = tokens[start : start + 2048]
            self._decode([(t, start + i, seq, start + i == len(tokens) - 1) for i, t in enumerate(chunk)])

    def prefill_tps(self, tokens: list[int], repeats: int, warm: bool = True) -> float:
        """Prompt tok/s, the median of `repeats` prefills (after one untimed, with warm: as QuillRunner's)."""
        times = []
        for _ in range(repeats + warm):
            self._clear()
            t0 = time.perf_counter()
            self._prefill(tokens, 0)
            times.append(time.perf_counter() - t0)
        return len(tokens) / statistics.median(times[warm:])

    def decode_tps(self, tokens: list[int], batch: int, steps: int, repeats: int) -> float:
        """Aggregate tok/s of `batch` sequences decoding together from a `len(tokens)` context."""
        L = self.L
        times = []
        for _ in range(repeats):
            self._clear()
            self._prefill(tokens, 0)
            mem = L.llama_get_memory(self.ctx)
            for s in range(1, batch):
                L.llama_memory_seq_cp(mem, 0, s, -1, -1)
            pos = len(tokens)
            t0 = time.perf_counter()
            for step in range(steps):
                self._decode([(tokens[(step + s) % len(tokens)], pos + step, s, True) for s in range(batch)])
            times.append(time.perf_counter() - t0)
        return batch * steps / statistics.median(times)

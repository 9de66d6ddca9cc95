"""quill's side of `bench latency`: prefill and decode timed through the real engine step."""

from __future__ import annotations

import statistics
import time

from quill.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from quill.engine.engine import LLMEngine, freeze_heap
from quill.sampling_params import SamplingParams

_TEXT = ("The history of computing is a story of people, machines and ideas. Engineers built "
         "faster circuits, wrote better programs and taught the machines to read and write. ")


class QuillRunner:
    """An engine with room for `max_batch` sequences of `max_len` tokens, prefix cache off."""

    def __init__(self, model: str | None, threads: int | None, max_len: int, max_batch: int, kv_cache_dtype: str = "auto",
                 skip_prefill: bool = False, activations: str | None = None):
        self.skip_prefill = skip_prefill
        blocks = max_batch * (-(-(max_len + 64) // 16)) + 8
        cfg = EngineConfig(
            model=model, threads=threads, max_model_len=None, activations=activations,
            speculative=SpeculativeConfig("off"),  # kernel speed, one token per step (--speculative measures it)
            cache=CacheConfig(block_size=16, enable_prefix_caching=False, num_blocks_override=blocks,
                              kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_batched_tokens=max(max_len, 2048), max_num_seqs=max(max_batch, 16)),
        )
        self.engine = LLMEngine(cfg)
        freeze_heap()  # the bench owns its process; as quill serve does
        self.threads = self.engine.threads
        self.model_name = self.engine.model_name
        self.model_path = self.engine.loaded.path
        self.weight_bytes = self.engine.loaded.model.resident_bytes()
        self.step_weight_bytes = self.engine.loaded.model.decode_read_bytes()
        self.file_bytes = self.engine.loaded.file_bytes  # the GGUF's size on disk (stat), as `quill info` reports
        self.kv_bytes_per_token = self.engine.kv_cache.bytes_per_token
        self.kv_cache_dtype = self.engine.kv_cache_dtype
        self.activations = "int8" if self.engine.kernel_options.int8 else "exact"
        self._ids = 0

    def close(self) -> None:
        """Let the engine (weights, KV pool) go, so a next runner's model is never held alongside it.
        freeze_heap moved it out of the cyclic collector's reach: unfreeze, drop it, collect."""
        import gc

        self.engine = None
        gc.unfreeze()
        gc.collect()

    def gemv_read_rate(self, repeats: int) -> dict | None:
        """The decode GEMV kernel alone at batch 1 over every quantized weight (each layer's projections, then
        the LM head), in model order as a step reads them: bytes read, ms, GB/s. None without packed weights."""
        from quill.kernels.options import use

        with use(self.engine.kernel_options):  # this engine's ISA, threads and activations, as its steps
            return self._gemv_read_rate(repeats)

    def _gemv_read_rate(self, repeats: int) -> dict | None:
        import torch

        from quill.kernels.packed import PackedLinear

        model = self.engine.loaded.model
        linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
        if not linears or linears[0]._lib is None:
            return None
        xs = {lin.in_features: torch.randn(1, lin.in_features) for lin in linears}
        scratch = torch.empty(max(lin.scratch_floats(1) for lin in linears))
        calls = [lin.bind_gemv(xs[lin.in_features], torch.empty(1, lin.out_features), scratch) for lin in linears]
        times = []
        for _ in range(repeats + 1):  # the first pass warms the caches' code paths
            t0 = time.perf_counter()
            for call in calls:
                call()
            times.append(time.perf_counter() - t0)
        nbytes = sum(lin.weight.nbytes for lin in linears)
        seconds = statistics.median(times[1:])
        return {"weight_bytes": nbytes, "ms": seconds * 1000, "gbs": nbytes / seconds / 1e9,
                "layout": type(linears[0].weight).__name__}

    def sample_tokens(self, n: int) -> list[int]:
        ids = self.engine.tokenizer.encode(_TEXT * (n // 20 + 2), add_special_tokens=False)
        return ids[:n]

    def _add(self, tokens: list[int], max_tokens: int) -> str:
        self._ids += 1
        rid = f"bench-{self._ids}"
        self.engine.add_request(rid, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return rid

    def _drain(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
        self.engine.step()

    def _mark_prompts_computed(self) -> None:
        """--skip-prefill: admit every waiting sequence with all but its last prompt token marked
        computed, over freshly allocated blocks (prefix cache off, so each row has its own) whose
        K/V are whatever the pool holds. The first step is then a decode row at the full context,
        and each step reads the same bytes as after a real prefill; the text is meaningless."""
        from quill.engine.sequence import SequenceStatus

        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        while scheduler.waiting:
            seq = scheduler.waiting.popleft()
            if not blocks.allocate(seq, seq.num_tokens - 1):
                raise RuntimeError(f"the bench's KV pool cannot hold {seq.num_tokens} tokens x the batch")
            seq.num_computed_tokens = seq.num_tokens - 1
            seq.status = SequenceStatus.RUNNING
            scheduler.running.append(seq)

    def prefill_tps(self, tokens: list[int], repeats: int, warm: bool = True) -> float:
        """Prompt tok/s, the median of `repeats` prefills (after one untimed that warms buffers, with warm)."""
        times = []
        for _ in range(repeats + warm):
            self._add(tokens, 1)
            t0 = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - t0)
            self._drain()
        return len(tokens) / statistics.median(times[warm:])

    def decode_tps(self, tokens: list[int], batch: int, steps: int, repeats: int) -> float:
        times = []
        self.last_breakdown = None
        for _ in range(repeats):
            for _ in range(batch):
                self._add(tokens, steps + 4)
            if self.skip_prefill:
                self._mark_prompts_computed()
            while any(s.num_output_tokens == 0 for s in self.engine.scheduler.running) or self.engine.scheduler.waiting:
                self.engine.step()
            ks = self.engine.runner.kernel_seconds
            before = dict(ks)
            t0 = time.perf_counter()
            for _ in range(steps):
                self.engine.step()
            elapsed = time.perf_counter() - t0
            times.append(elapsed)
            layers, head = ks["layers"] - before["layers"], ks["lm_head"] - before["lm_head"]
            self.last_breakdown = {"step_ms": elapsed / steps * 1000, "layers_ms": layers / steps * 1000,
                                   "lm_head_ms": head / steps * 1000,
                                   "overhead_ms": (elapsed - layers - head) / steps * 1000}
            self._drain()
        return batch * steps / statistics.median(times)

"""LLMEngine: admit requests, step the scheduler and the model, detokenize, stop, report."""

from __future__ import annotations

import itertools
from collections import Counter
import logging
import threading
import time
from dataclasses import dataclass, field

from quill.config import EngineConfig, resolve_kv_dtype
from quill.engine.block_manager import BlockManager
from quill.engine.errors import AdmissionError
from quill.engine.faults import FAULT_PHASES, FaultPlan, InjectedFault
from quill.engine.kv_cache import KV_CACHE_DTYPES, KVCache, num_blocks_for
from quill.engine.metrics import now
from quill.engine.model_runner import ModelRunner, StepResult
from quill.engine.request_state import RequestState
from quill.engine.sampler import Sampler
from quill.engine.scheduler import Scheduler, SchedulerOutput
from quill.engine.sequence import Sequence, SequenceStatus
from quill.engine.stats import EngineStats
from quill.engine.stop_checker import StopChecker
from quill.kernels.options import resolve as resolve_kernel_options, use as use_kernel_options
from quill.models.loader import LoadedModel, load_model
from quill.outputs import RequestOutput
from quill.sampling_params import SamplingParams

logger = logging.getLogger("quill.engine")


@dataclass
class StepInfo:
    """What the last step did (trace and gauges read this)."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    seconds: float = 0.0
    preempted: list[str] = field(default_factory=list)
    verified: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)  # per VERIFY row: (request id,
    # the proposed token ids, how many of them were accepted)


# What a request was doing when it failed, for its error message (the keys are FAULT_PHASES).
_PHASE_WORDS = {
    "queued": "waiting to be scheduled",
    "prefill": "preparing its prompt chunk",
    "forward": "in the forward pass",
    "decode": "preparing its decode row",
    "sample": "sampling its next token",
    "grammar": "applying its grammar",
    "detokenize": "detokenizing its output",
    "stop": "checking its stop conditions",
}


class LLMEngine:
    """Synchronous engine: add_request / abort / step. One engine serves LLM and the server."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, kernel_options=None):
        """kernel_options (quill.kernels.options.KernelOptions): this engine's ISA, AMX and thread count;
        default: config.threads and the environment (QUILL_NO_AVX512, QUILL_NO_AMX) read now."""
        self.config = config
        started = time.perf_counter()
        from quill.kernels.threads import configure_threads

        self.threads = configure_threads(kernel_options.threads if kernel_options else config.threads)
        if config.activations not in (None, "exact", "int8"):
            raise ValueError(f"activations must be 'exact' or 'int8', got {config.activations!r}")
        int8 = None if config.activations is None else config.activations == "int8"
        self.kernel_options = kernel_options or resolve_kernel_options(self.threads, int8=int8)
        with use_kernel_options(self.kernel_options):  # the weights' layout (AMX tiles or not) follows them
            fresh = loaded is None
            self.loaded = loaded or load_model(config.model, device=config.device, quantize=config.quantize,
                                               context_len=config.max_model_len, cache_dir=config.cache_dir)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings, self.loaded.model.context_len)
        cache = config.cache
        self.kv_cache_dtype = resolve_kv_dtype(cache.kv_cache_dtype, self.loaded.origin_format)
        dtype = KV_CACHE_DTYPES[self.kv_cache_dtype]
        self.draft_loaded = self._load_draft(config)  # a separate draft model, or None
        draft_config = self.draft_loaded.config if self.draft_loaded is not None else None
        num_blocks = num_blocks_for(cache, self.model_config, dtype.itemsize, draft=draft_config)
        self.kv_cache = KVCache(self.model_config, num_blocks, cache.block_size, dtype, device=config.device)
        # the draft's own K/V, in blocks of the same ids (one block manager for both)
        self.draft_kv_cache = (KVCache(draft_config, num_blocks, cache.block_size, dtype, device=config.device)
                               if draft_config is not None else None)
        self.block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.eos_token_ids = tuple(sorted(set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids)))
        # ids past the tokenizer's vocabulary are padding rows of the embedding: never sample them
        sampler = Sampler(min(self.model_config.vocab_size, self.tokenizer.vocab_size), self.eos_token_ids)
        self.faults = FaultPlan()  # armed only by tests and --enable-fault-injection
        with use_kernel_options(self.kernel_options):  # the fused decoder takes them
            self.runner = ModelRunner(self.loaded.model, self.model_config, self.kv_cache, sampler, config.device,
                                      faults=self.faults)
        self.stop_checker = StopChecker(self.eos_token_ids, self.max_model_len)
        self.speculator, self.speculative_refusal = self._speculator(config)
        self.requests: dict[str, RequestState] = {}
        self.stats = EngineStats()
        self.last_step = StepInfo()
        load_ms = self.loaded.load_ms if fresh else 0.0  # weights loaded elsewhere cost this engine nothing
        self.cold_start = {"load_ms": load_ms, "load_format": self.loaded.file_format,
                           "load_phases": self.loaded.load_phases if fresh else {},
                           "engine_ms": (time.perf_counter() - started) * 1000.0 - load_ms}
        self.guided_compiler = None  # built lazily on the first constrained request
        self._guided_lock = threading.Lock()  # validate() may run on another thread than step()
        self._seq_ids = itertools.count()  # this engine's sequence numbers
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f KiB per token (%s), %.1f MiB",
            num_blocks, cache.block_size, self.kv_cache.capacity_tokens, self.kv_cache.bytes_per_token / 1024,
            self.kv_cache_dtype, num_blocks * cache.block_size * self.kv_cache.bytes_per_token / 2**20,
        )
        if self.draft_kv_cache is not None:
            draft_bytes = self.draft_kv_cache.bytes_per_token
            logger.info("draft model %s: its own K/V in the same blocks, %.1f KiB per token, %.1f MiB",
                        self.draft_loaded.name, draft_bytes / 1024, num_blocks * cache.block_size * draft_bytes / 2**20)

    def _load_draft(self, config: EngineConfig) -> LoadedModel | None:
        """--draft-model: load it and check it can guess for this target (its tokenizer maps every
        token as the target's does, and its context covers the served one)."""
        path = config.speculative.draft_model
        if path is None:
            return None
        with use_kernel_options(self.kernel_options):
            draft = load_model(path, device=config.device, quantize=config.speculative.draft_quantize,
                               context_len=self.max_model_len)
        mine, theirs = self.tokenizer.hf.get_vocab(), draft.tokenizer.hf.get_vocab()
        differ = next((tok for tok, i in mine.items() if theirs.get(tok) != i), None)
        if differ is not None:
            raise ValueError(f"draft model {draft.name} has another tokenizer: token {differ!r} is "
                             f"{mine[differ]} in {self.loaded.name} and {theirs.get(differ)} in the draft "
                             f"({len(mine):,} and {len(theirs):,} tokens); a draft must share the target's tokenizer")
        if draft.model.context_len < self.max_model_len:
            raise ValueError(f"draft model {draft.name} covers {draft.model.context_len:,} positions, fewer than the "
                             f"{self.max_model_len:,} served (lower --max-model-len to {draft.model.context_len:,})")
        return draft

    def _speculator(self, config: EngineConfig):
        """-> (Speculator or None, why speculation is off though asked for, or None)."""
        if not config.speculative.enabled:
            return None, None
        if self.runner.fused is None:
            why = f"verification needs the batch-invariant fused decode path, and this model has none ({self.runner.fused_refusal})"
            logger.warning("speculative decoding off: %s", why)
            return None, why
        from quill.engine.speculative import Speculator

        draft = None
        if config.speculative.method == "draft":
            draft, why = self._draft_runner(config)
            if draft is None:
                logger.warning("speculative decoding off: %s", why)
                return None, why
        return Speculator(config.speculative, self.max_model_len, self._stop_token_ids, draft), None

    def _draft_runner(self, config: EngineConfig):
        """-> (DraftRunner, None), or (None, why the draft cannot run)."""
        from quill.engine.draft import DraftRunner

        vocab, tables, bs = self.runner.sampler.vocab_size, self.runner.block_tables, self.kv_cache.block_size
        layers = config.speculative.draft_layers
        if layers is not None:
            total = self.model_config.num_layers
            if layers[-1] >= total or len(layers) >= total:
                raise ValueError(f"draft layers {list(layers)} must be fewer than the target's {total} layers, "
                                 f"numbered 0 to {total - 1}")
            return DraftRunner(self.loaded.model, self.runner.fused, tables, bs, vocab, layers=layers), None
        with use_kernel_options(self.kernel_options):
            own = ModelRunner(self.draft_loaded.model, self.draft_loaded.config, self.draft_kv_cache, None, config.device)
        if own.fused is None:
            return None, f"the draft model {self.draft_loaded.name} has no fused decode path ({own.fused_refusal})"
        return DraftRunner(self.draft_loaded.model, own.fused, tables, bs, vocab, prefill=own), None

    @property
    def model_name(self) -> str:
        return self.loaded.name

    # ---- admission --------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Reject what can never run, naming the limit and the value.

        Safe to call from another thread than step(): it reads configuration, compiles a grammar
        through the thread-safe compiler, and reads the waiting queue's length; it changes nothing."""
        n = len(prompt_token_ids)
        if n == 0:
            raise AdmissionError("prompt is empty (0 tokens)", param="prompt")
        if n >= self.max_model_len:
            raise AdmissionError(
                f"prompt is {n:,} tokens; this model's context is {self.max_model_len:,} tokens "
                "(at least one must be left for the answer)",
                param="prompt", code="context_length_exceeded",
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise AdmissionError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
        total = min(n + (params.max_tokens or self.max_model_len), self.max_model_len)
        bs = self.block_manager.block_size
        need = -(-total // bs)
        if need > self.block_manager.num_blocks:
            raise AdmissionError(
                f"prompt ({n:,} tokens) plus max_tokens needs {total:,} tokens of KV cache; the whole pool holds "
                f"{self.block_manager.num_blocks * bs:,} tokens (raise --kv-cache-memory or lower max_tokens)",
                param="max_tokens", code="context_length_exceeded",
            )
        if params.logit_bias:  # against the ids the sampler draws from (the model's and tokenizer's vocab, the smaller)
            params.check_logit_bias(self.runner.sampler.vocab_size)
        if params.constrained:
            self._grammar_compiler().validate(params)
        max_waiting = self.config.scheduler.max_waiting
        if max_waiting is not None and len(self.scheduler.waiting) >= max_waiting:
            raise AdmissionError(
                f"server busy: {len(self.scheduler.waiting)} requests waiting, limit --max-waiting {max_waiting}",
                code="queue_full", status=503,
            )

    def check_fault_phase(self, phase: str) -> None:
        """Refuse a fault-injection request unless this engine allows it and the phase exists."""
        if not self.config.fault_injection:
            raise AdmissionError("fault injection is off (start the server with --enable-fault-injection)",
                                 param="X-Quill-Fault")
        if phase not in FAULT_PHASES:
            raise AdmissionError(f"unknown fault phase {phase!r}; the phases are {', '.join(FAULT_PHASES)}",
                                 param="X-Quill-Fault")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None, fault: str | None = None) -> None:
        """Queue a request. `fault` (tests, soak runs) makes it fail at that phase; see faults.py."""
        if request_id in self.requests:
            raise AdmissionError(f"request id {request_id!r} is already running", param="request_id")
        self.validate(prompt_token_ids, params)
        if fault is not None:
            self.check_fault_phase(fault)
        arrival = arrival_time if arrival_time is not None else now()
        seqs = [Sequence(request_id, prompt_token_ids, params, index=i, arrival_time=arrival, seq_id=next(self._seq_ids))
                for i in range(params.n)]
        state = RequestState(request_id, prompt, list(prompt_token_ids), seqs, self.tokenizer)
        if params.constrained:
            state.attach_matchers(self._grammar_compiler())
            if self.runner.guided is None:
                from quill.engine.guided import MaskWorker

                self.runner.guided = MaskWorker(self.requests_matcher)
        if fault is not None:
            self.faults.arm(request_id, fault)
        self.requests[request_id] = state
        for seq in seqs:
            self.scheduler.add(seq)

    def _grammar_compiler(self):
        with self._guided_lock:
            if self.guided_compiler is None:
                from quill.engine.guided import GrammarCompiler

                self.guided_compiler = GrammarCompiler(self.tokenizer.hf, self.eos_token_ids, self.model_config.vocab_size)
            return self.guided_compiler

    def requests_matcher(self, seq: Sequence):
        state = self.requests.get(seq.request_id)
        return None if state is None else state.matchers.get(seq.index)

    def abort(self, request_id: str) -> bool:
        """End a request now: its blocks are freed before this returns."""
        state = self.requests.get(request_id)
        if state is None:
            return False
        for seq in state.seqs:
            if not seq.is_finished:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED, None)
        state.aborted = True
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step. A failure in one request's own work (its rows' preparation, sampling,
        grammar, detokenizing, stop check) finishes that request alone with finish_reason "error";
        a failed forward pass is retried once without the batch's newest request."""
        started = time.perf_counter()
        outputs = self.step_aborted()
        touched: dict[str, RequestState] = {}
        if self.faults:
            self._check_queued(touched)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, lambda seq: self.requests_matcher(seq) is not None)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError(f"scheduler stalled: {len(self.scheduler.waiting)} waiting, none fit "
                                   f"({self.block_manager.num_free_blocks} free blocks)")
            return outputs + [self._emit(state) for state in touched.values()]
        t0 = time.perf_counter()
        if self.faults:
            self._check_rows(sched, touched)
        with use_kernel_options(self.kernel_options):  # shared modules' kernel calls (prefill, LM head)
            if self.speculator is not None:
                self.speculator.fill(sched.scheduled)  # a draft model's guesses for the VERIFY rows
            num_prefill, num_decode = sched.num_prefill_tokens, sched.num_decode_tokens  # before tokens are appended
            result = self._execute(sched, touched)
        self.scheduler.postprocess(sched)
        when = now()
        for seq, phase, exc in result.failed:
            self._fail(seq, phase, exc, touched)
        times = _token_times(result.sampled, when)
        kept: Counter = Counter()  # tokens each sequence really took this step (a run stops at a stop)
        previous = None
        for (seq, token_id, logprobs), at in zip(result.sampled, times):
            state = self.requests.get(seq.request_id)
            if state is None or seq.is_finished:  # a sibling completion failed this step, or a run's stop
                continue
            if seq is previous:  # the token before this one, in the same VERIFY run, was an accepted proposal
                self.scheduler.accept_draft(seq)
            previous = seq
            self._accept_token(state, seq, token_id, logprobs, at, touched)
            kept[seq.seq_id] += 1
            touched[seq.request_id] = state
        verified = [(s, proposed, max(kept[s.seq_id] - 1, 0)) for s, proposed, _ in result.verified]
        step_verified = [(s.request_id, tuple(s.draft_token_ids[:proposed]), accepted) for s, proposed, accepted in verified]
        self._settle_verified(verified)
        elapsed = time.perf_counter() - t0
        self.last_step = StepInfo(num_prefill, num_decode, elapsed, [s.request_id for s in sched.preempted],
                                  step_verified)
        self.stats.record_step(num_prefill, num_decode, elapsed, len(sched.preempted))
        if self.speculator is not None and not num_prefill and num_decode:
            self.speculator.record_step(num_decode, time.perf_counter() - started)
        for state in touched.values():
            outputs.append(self._emit(state))
        return outputs

    def _settle_verified(self, verified: list) -> None:
        """After a step's VERIFY rows (seq, proposed, accepted and taken): publish the accepted proposals'
        full blocks, roll back the rest, count them."""
        if self.speculator is None:  # no proposals, so no VERIFY rows
            return
        for seq, proposed, accepted in verified:
            if self.scheduler.settle_run(seq):
                self.runner.forget_block_table(seq)
            self.speculator.record(seq, proposed, accepted)
            self.stats.record_speculation(proposed, accepted)
        self.speculator.clear()

    def _check_queued(self, touched: dict) -> None:
        for seq in list(self.scheduler.waiting):
            try:
                self.faults.check("queued", seq.request_id)
            except Exception as exc:  # noqa: BLE001
                self._fail(seq, "queued", exc, touched)

    def _check_rows(self, sched: SchedulerOutput, touched: dict) -> None:
        """Each scheduled row's own preparation: a request that fails here leaves the batch."""
        failed = []
        for item in sched.scheduled:
            phase = "decode" if item.is_decode else "prefill"
            try:
                self.faults.check(phase, item.seq.request_id)
            except Exception as exc:  # noqa: BLE001
                failed.append((item.seq, phase, exc))
        self._drop(sched, failed, touched)

    def _drop(self, sched: SchedulerOutput, failed: list, touched: dict) -> None:
        """Fail these sequences' requests and take every row of those requests out of the step."""
        if not failed:
            return
        gone = {seq.request_id for seq, _, _ in failed}
        sched.without([item.seq for item in sched.scheduled if item.seq.request_id in gone])
        for seq, phase, exc in failed:
            self._fail(seq, phase, exc, touched)

    def _execute(self, sched: SchedulerOutput, touched: dict) -> StepResult:
        """Run the step. If the forward pass raises, find the request(s) it fails for: retry first
        without the batch's newest request (the likeliest cause), then that request alone, and so
        on by halves over what still fails, so only a request whose rows fail on their own is
        failed ("forward"); everyone else gets this step's results. Costs nothing unless a
        forward fails; then about 2 extra passes per failing request. Decode rows are batch-
        invariant, so a row computed in a smaller retry gives the same numbers."""
        if sched.is_empty:
            return StepResult([])
        try:
            return self.runner.execute(sched)
        except Exception as exc:  # noqa: BLE001
            by_age = self._requests_by_age(sched)
            logger.warning("forward pass failed for a batch of %d request(s) (%s: %s); retrying without the newest, %s",
                           len(by_age), type(exc).__name__, exc, by_age[-1])
            if len(by_age) == 1:
                logger.error("forward pass failed for request %s alone", by_age[0], exc_info=_traceback(exc))
                self._drop(sched, [(item.seq, "forward", exc) for item in sched.scheduled], touched)
                return StepResult([])
        result = StepResult([])
        for group in (by_age[:-1], by_age[-1:]):
            part = self._isolate(sched, group, touched)
            result.sampled += part.sampled
            result.failed += part.failed
            result.verified += part.verified
        return result

    def _isolate(self, sched: SchedulerOutput, request_ids: list[str], touched: dict) -> StepResult:
        """Execute the rows of these requests (of sched) alone; on failure, split them in halves."""
        wanted = set(request_ids)
        sub = SchedulerOutput([item for item in sched.scheduled if item.seq.request_id in wanted])
        if sub.is_empty:
            return StepResult([])
        try:
            return self.runner.execute(sub)
        except Exception as exc:  # noqa: BLE001
            if len(request_ids) == 1:
                logger.error("forward pass fails for request %s on its own", request_ids[0], exc_info=_traceback(exc))
                self._drop(sched, [(item.seq, "forward", exc) for item in sub.scheduled], touched)
                return StepResult([])
        half = len(request_ids) // 2
        first, second = self._isolate(sched, request_ids[:half], touched), self._isolate(sched, request_ids[half:], touched)
        return StepResult(first.sampled + second.sampled, first.failed + second.failed, first.verified + second.verified)

    @staticmethod
    def _requests_by_age(sched: SchedulerOutput) -> list[str]:
        """The step's request ids, oldest arrival first."""
        oldest: dict[str, tuple] = {}
        for item in sched.scheduled:
            key = (item.seq.metrics.arrival_time, item.seq.seq_id)
            rid = item.seq.request_id
            oldest[rid] = min(oldest.get(rid, key), key)
        return sorted(oldest, key=oldest.get)

    def step_aborted(self) -> list[RequestOutput]:
        """Emit the final outputs of aborted requests without running the model."""
        done = [s for s in self.requests.values() if s.aborted]
        return [self._emit(s) for s in done]

    def _accept_token(self, state: RequestState, seq: Sequence, token_id: int, logprobs, when: float,
                      touched: dict) -> None:
        seq.append_token(token_id, when)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        phase = "grammar"
        try:
            matcher = state.matchers.get(seq.index)
            if self.faults:
                self.faults.check("grammar", seq.request_id)
            if matcher is not None and not self._is_stop_token(seq, token_id):
                matcher.accept(token_id)
            phase = "detokenize"
            if self.faults:
                self.faults.check("detokenize", seq.request_id)
            text = state.detokenize(seq, token_id)
            phase = "stop"
            if self.faults:
                self.faults.check("stop", seq.request_id)
            result = self.stop_checker.check(seq, text, state.new_chars(seq))
            if result is not None:
                final = result.text
                if result.finish_reason == "length":
                    final += state.flush(seq)  # bytes of a character cut off by the limit
        except Exception as exc:  # noqa: BLE001 - this request's failure alone
            self._fail(seq, phase, exc, touched)
            return
        if result is not None:
            state.set_final_text(seq, final)
            seq.stop_reason = result.stop_reason
            status = SequenceStatus.FINISHED_STOPPED if result.finish_reason == "stop" else SequenceStatus.FINISHED_LENGTH
            self._finish(seq, status, result)

    def _fail(self, seq: Sequence, phase: str, exc: BaseException, touched: dict) -> None:
        """Finish seq's whole request with finish_reason "error"; nothing else is touched."""
        state = self.requests.get(seq.request_id)
        if state is None:
            return
        if state.error is None:
            state.error = f"request failed while {_PHASE_WORDS.get(phase, phase)}: {type(exc).__name__}: {exc}"
            logger.error("request %s failed at phase %s: %s: %s", seq.request_id, phase, type(exc).__name__, exc,
                         exc_info=_traceback(exc))
            self.stats.record_failure(phase)
        for s in state.seqs:
            if not s.is_finished:
                self._finish(s, SequenceStatus.FINISHED_ERROR, None)
        self.faults.disarm(seq.request_id)
        touched[seq.request_id] = state

    def _stop_token_ids(self, seq: Sequence) -> tuple[int, ...]:
        """The one rule for which token ids stop seq: EOS (unless ignore_eos) and its stop_token_ids."""
        return (*(() if seq.params.ignore_eos else self.eos_token_ids), *seq.params.stop_token_ids)

    def _is_stop_token(self, seq: Sequence, token_id: int) -> bool:
        return token_id in self._stop_token_ids(seq)

    def _finish(self, seq: Sequence, status: SequenceStatus, result) -> None:
        self.scheduler.finish(seq, status)
        self.runner.release(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        self.stats.record_finish(seq)
        m = seq.metrics
        logger.info(
            "request %s[%d] prompt=%d cached=%d output=%d queue_ms=%s ttft_ms=%s prompt_tps=%s gen_tps=%s finish=%s",
            seq.request_id, seq.index, m.prompt_tokens, m.cached_tokens, m.output_tokens,
            _fmt(m.queue_time, 1000), _fmt(m.ttft, 1000), _fmt(m.prompt_tps), _fmt(m.generation_tps),
            status.finish_reason,
        )

    def _emit(self, state: RequestState) -> RequestOutput:
        out = state.make_output()
        if out.finished:
            self.requests.pop(state.request_id, None)
            self.faults.disarm(state.request_id)
        return out

    # ---- gauges -------------------------------------------------------------------------------
    def cached_block_hashes(self) -> list:
        """Block digests (block_pool.hash_block_tokens chains) this engine's prefix cache holds:
        what a prefix-aware router compares a prompt's prefix_block_hashes with."""
        return self.block_manager.cached_hashes()

    def gauges(self) -> dict:
        bm = self.block_manager
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_cached": bm.num_cached_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "prefix_cache_hit_rate": bm.hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            **self.stats.as_dict(),
        }


def _token_times(sampled: list, when: float) -> list[float]:
    """When each sampled token counts as produced. A sequence that gets m tokens from one step (a
    VERIFY row's accepted run) has them spread evenly since its previous token, the last at `when`,
    so inter-token latency counts tokens, not steps."""
    counts = Counter(seq.seq_id for seq, _, _ in sampled)
    starts: dict[int, float] = {}
    done: Counter = Counter()
    times = []
    for seq, _, _ in sampled:
        m = counts[seq.seq_id]
        if m == 1:
            times.append(when)
            continue
        if seq.seq_id not in starts:
            before = seq.metrics.token_times
            starts[seq.seq_id] = before[-1] if before else when
        done[seq.seq_id] += 1
        start = starts[seq.seq_id]
        times.append(start + (when - start) * done[seq.seq_id] / m)
    return times


def _traceback(exc: BaseException) -> BaseException | None:
    """A real failure's traceback belongs in the log; an injected one's says nothing new."""
    return None if isinstance(exc, InjectedFault) else exc


def freeze_heap() -> None:
    """For the owner of a whole process (quill serve, the CLI commands, the bench runner), once
    its engine is built: collect, then move everything alive (weights, tokenizer, caches) out of
    the cyclic collector's generations so decode steps never rescan it. gc.freeze() is process-
    wide, so an engine never calls it itself: a library user's process is theirs to tune."""
    import gc

    gc.collect()
    gc.freeze()


def _fmt(x, scale: float = 1.0) -> str:
    return "-" if x is None else f"{x * scale:.1f}"

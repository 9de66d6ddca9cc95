"""A stand-in for AsyncEngine (ENGINE_API.md) for server tests: canned tokens, small delays.

One token per character (byte ids 0..255). Each request runs as its own task that keeps
producing whether or not anyone reads it, like the real engine's loop thread, so a server
that forgets to abort leaves it "decoding for nobody" and the tests can see that.
"""

from __future__ import annotations

import asyncio
import math
import random

from quill.engine.errors import AdmissionError, RequestFailed
from quill.engine.metrics import RequestMetrics, now
from quill.outputs import CompletionOutput, RequestOutput
from quill.sampling_params import ParamError

EOS = 256
GREEDY_TEXT = "The quick brown fox jumps over the lazy dog."


class FakeTokenizer:
    """Bytes as tokens, plus an EOS id and a trivial chat template."""

    vocab_size = 260
    eos_token_ids = (EOS,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def id_to_piece(self, token_id: int) -> str:
        return "<eos>" if token_id == EOS else self.decode([token_id])

    def added_token_kind(self, text: str) -> str | None:
        return None  # bytes only: every marker is spelt out

    def added_token_id(self, text: str) -> int | None:
        return None

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        for i, m in enumerate(messages):
            if m["role"] == "system" and i != 0:
                raise ValueError("a system message must come first")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode_chat(self, messages) -> list[int]:
        return self.encode(self.apply_chat_template(messages))


class _Request:
    def __init__(self, request_id, prompt_ids, params, cached):
        self.id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.cached = cached
        self.queue: asyncio.Queue = asyncio.Queue()
        self.abort_event = asyncio.Event()
        self.phase = "queued"  # queued | prefill | decode | done
        self.task: asyncio.Task | None = None


class FakeEngine:
    """Implements the AsyncEngine surface the server uses."""

    def __init__(self, *, max_model_len=512, max_num_seqs=4, max_waiting=None, token_delay=0.005,
                 prefill_delay_per_token=0.0, block_size=4, num_blocks=256, greedy_text=GREEDY_TEXT):
        self.tokenizer = FakeTokenizer()
        # What a greedy request writes (ASCII, one token per character), then EOS: a string, or a
        # function of the prompt's text, so that a test can script each request's output.
        self.greedy_text = greedy_text
        self.model_config = None
        self.max_model_len = max_model_len
        self.model_name = "fake-model"
        self.cold_start = {"load_ms": 1.0, "warmup_ms": 1.0, "ready_ms": 2.0}
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.token_delay = token_delay
        self.prefill_delay_per_token = prefill_delay_per_token
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.on_request_finished: list = []
        self.is_running = False
        self.requests: dict[str, _Request] = {}
        self.aborted: dict[str, str] = {}  # request id -> phase it was in when aborted
        self.finished: dict[str, str] = {}  # request id -> finish reason of choice 0
        self.seen_prompts: list[tuple[int, ...]] = []
        self.abort_calls: list[str] = []
        self.received_params: dict = {}
        self.received_faults: dict[str, str] = {}  # request id -> the fault phase it was armed with
        self._slots: asyncio.Semaphore | None = None

    def start(self) -> None:
        self.is_running = True

    def shutdown(self, drain_timeout=None) -> None:
        self.is_running = False

    # ---- the request path -------------------------------------------------------------

    def _validate(self, prompt_ids, params, request_id) -> None:
        if params.regex == "(":
            raise ParamError("regex", "unbalanced parenthesis in '('")
        budget = params.max_tokens or 0
        if len(prompt_ids) + budget > self.max_model_len:
            raise AdmissionError(f"prompt {len(prompt_ids)} + max_tokens {budget} > {self.max_model_len}", param="max_tokens", code="context_length_exceeded", status=400)
        waiting = sum(1 for r in self.requests.values() if r.phase == "queued")
        if self.max_waiting is not None and waiting >= self.max_waiting:
            raise AdmissionError(f"{waiting} requests are waiting; the limit is {self.max_waiting}", code="queue_full", status=503)
        if request_id in self.requests:
            raise AdmissionError(f"duplicate request id {request_id}")

    async def generate(self, prompt_token_ids, params, request_id, prompt=None, fault=None):
        if fault is not None:
            self.received_faults[request_id] = fault
        self._validate(prompt_token_ids, params, request_id)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_num_seqs)
        req = _Request(request_id, list(prompt_token_ids), params, self._cached_prefix(prompt_token_ids))
        self.requests[request_id] = req
        self.received_params[request_id] = params
        req.task = asyncio.create_task(self._run_safe(req))
        try:
            while True:
                output = await req.queue.get()
                if isinstance(output, Exception):
                    raise output
                yield output
                if output.finished:
                    return
        finally:
            if req.phase != "done":
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        req = self.requests.get(request_id)
        if req is not None:
            req.abort_event.set()

    def _cached_prefix(self, ids) -> int:
        best = 0
        for seen in self.seen_prompts:
            common = 0
            for a, b in zip(seen, ids):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        self.seen_prompts.append(tuple(ids))
        return min(best // self.block_size * self.block_size, max(len(ids) - 1, 0))

    async def _run_safe(self, req: _Request) -> None:
        try:
            await self._run(req)
        except Exception as exc:  # a bug in the fake must fail the test, not hang it
            req.queue.put_nowait(exc)

    async def _run(self, req: _Request) -> None:
        p = req.params
        script = self.greedy_text(self.tokenizer.decode(req.prompt_ids)) if callable(self.greedy_text) else self.greedy_text
        choices = [_Choice(i, p, script) for i in range(p.n)]
        for c in choices:
            c.metrics = RequestMetrics(prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached)
        acquired = False
        try:
            if not await self._wait(req, self._slots.acquire()):
                return self._finish(req, choices, "abort")
            acquired = True
            req.phase = "prefill"
            for c in choices:
                c.metrics.first_scheduled_time = now()
            delay = self.prefill_delay_per_token * (len(req.prompt_ids) - req.cached)
            if not await self._wait(req, asyncio.sleep(delay)):
                return self._finish(req, choices, "abort")
            req.phase = "decode"
            if "FAIL_EARLY" in self.tokenizer.decode(req.prompt_ids):  # fails before its first output
                self._finish(req, choices, "error", deliver=False)
                req.queue.put_nowait(RequestFailed(f"request {req.id} failed at phase 'prefill': simulated", phase="prefill"))
                return None
            while True:
                for c in choices:
                    if not c.done:
                        c.step(self.tokenizer, req)
                if all(c.done for c in choices):
                    return self._finish(req, choices, None)
                req.queue.put_nowait(self._output(req, choices, finished=False))
                prompt_text = self.tokenizer.decode(req.prompt_ids)
                if "FAIL_MIDSTREAM" in prompt_text and len(choices[0].ids) >= 2:
                    req.queue.put_nowait(RuntimeError("simulated engine failure"))
                    return self._finish(req, choices, "abort", notify=False)
                if "FAIL_REQUEST" in prompt_text and len(choices[0].ids) >= 2:
                    # As the real engine: this request alone fails (finish_reason "error"), then raises.
                    self._finish(req, choices, "error", deliver=False)
                    req.queue.put_nowait(RequestFailed(f"request {req.id} failed at phase 'sample': simulated", phase="sample"))
                    return None
                if not await self._wait(req, asyncio.sleep(self.token_delay)):
                    return self._finish(req, choices, "abort")
        finally:
            if acquired:
                self._slots.release()

    async def _wait(self, req: _Request, awaitable) -> bool:
        """Await `awaitable` unless the request is aborted first (then False)."""
        work = asyncio.ensure_future(awaitable)
        stop = asyncio.ensure_future(req.abort_event.wait())
        await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if work.done() and not req.abort_event.is_set():
            return True
        work.cancel()
        if work.done() and not work.cancelled() and isinstance(work.result(), bool):
            self._slots.release()  # acquired just as the abort came
        return False

    def _finish(self, req, choices, reason, notify=True, deliver=True) -> None:
        if reason == "abort":
            self.aborted[req.id] = req.phase
        for c in choices:
            if not c.done:
                c.finish_reason = reason or "stop"
                c.done = True
            c.metrics.finished_time = now()
        req.phase = "done"
        self.finished[req.id] = choices[0].finish_reason
        out = self._output(req, choices, finished=True)
        if deliver:
            req.queue.put_nowait(out)
        del self.requests[req.id]
        if notify:
            for hook in self.on_request_finished:
                for completion in out.outputs:
                    hook(req.id, completion)

    def _output(self, req, choices, finished) -> RequestOutput:
        return RequestOutput(req.id, None, req.prompt_ids, [c.snapshot(self.tokenizer, finished) for c in choices], finished, req.cached)

    def stats(self) -> dict:
        used = sum(math.ceil((len(r.prompt_ids) + (r.params.max_tokens or 0)) / self.block_size)
                   for r in self.requests.values() if r.phase in ("prefill", "decode"))
        return {
            "running": sum(1 for r in self.requests.values() if r.phase in ("prefill", "decode")),
            "waiting": sum(1 for r in self.requests.values() if r.phase == "queued"),
            "kv_blocks_used": used,
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_cached": 0,
            "prefix_cache_hit_rate": 0.0,
            "num_requests_finished": {},
        }


class _Choice:
    """One completion's canned text, stop handling and incremental deltas."""

    def __init__(self, index, params, greedy_text=GREEDY_TEXT):
        self.index = index
        self.params = params
        self.greedy_text = greedy_text
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.done = False
        self.finish_reason = None
        self.stop_reason = None
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        seed = None if params.seed is None else params.seed * 1000 + index
        self.rng = random.Random(seed)
        self.metrics: RequestMetrics | None = None

    def _next_token(self) -> int:
        p, k = self.params, len(self.ids)
        if p.temperature == 0:
            if k >= len(self.greedy_text) and not p.ignore_eos and k >= p.min_tokens:
                return EOS
            return ord(self.greedy_text[k % len(self.greedy_text)])
        return ord(self.rng.choice("abcdefghij klmnop"))

    def step(self, tokenizer, req) -> None:
        token = self._next_token()
        self.metrics.token_times.append(now())
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = self.metrics.token_times[0]
        self.ids.append(token)
        if self.logprobs is not None:
            top = [(token, -0.25), (token + 1, -1.5), (token + 2, -2.5)][: self.params.logprobs]
            self.logprobs.append({"token_id": token, "logprob": -0.25, "top": top})
        if token == EOS or token in self.params.stop_token_ids:
            self.finish_reason, self.stop_reason, self.done = "stop", (None if token == EOS else token), True
            return
        self.text += tokenizer.decode([token])
        for stop in self.params.stop:
            at = self.text.find(stop)
            if at >= 0:
                keep = at + len(stop) if self.params.include_stop_str_in_output else at
                self.text = self.text[:keep]
                self.finish_reason, self.stop_reason, self.done = "stop", stop, True
                return
        if self.params.max_tokens is not None and len(self.ids) >= self.params.max_tokens:
            self.finish_reason, self.done = "length", True

    def _safe_len(self) -> int:
        """Text that cannot turn out to be the start of a stop string."""
        if self.done:
            return len(self.text)
        hold = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return len(self.text) - hold

    def snapshot(self, tokenizer, finished) -> CompletionOutput:
        safe = self._safe_len()
        delta = self.text[self.sent:safe]
        self.sent = max(self.sent, safe)
        metrics = {}
        if self.done:
            metrics = self.metrics.as_dict()
            metrics["itl_ms"] = [round(g * 1000.0, 3) for g in self.metrics.itl]
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.ids),
            finish_reason=self.finish_reason if self.done else None,
            delta_text=delta,
            stop_reason=self.stop_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            metrics=metrics,
        )

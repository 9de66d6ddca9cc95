"""What a replica is asked and where it should go: the call the ingress forwards, its prefix
key (quill's own KV block hashes of the rendered prompt), and the prefix-aware policy.

No Ray here: quill.cluster.ray_router wraps PrefixRoutingPolicy in Ray Serve's RequestRouter.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

from quill.engine.block_pool import BlockHash, prefix_block_hashes

PREFIX_ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
ROUTERS = ("prefix", "pow2", "round-robin", "ray-prefix")  # --router: quill's, Ray Serve's default, a baseline, Ray's LLM one
DEFAULT_IMBALANCE = 4  # --route-imbalance: in-flight spread between replicas above which the prefix router routes by load


@dataclass(frozen=True)
class QuillCall:
    """One HTTP request as the ingress forwards it to a replica, which runs it through the
    same FastAPI app as `quill serve` (quill.cluster.bridge). `block_hashes` is the routing key;
    `prompt` is the rendered prompt text, for routers that match on text (Ray's
    PrefixCacheAffinityRouter reads an argument's `prompt`), never empty."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None
    block_hashes: tuple[BlockHash, ...] = ()
    prompt: str = ""


def _text(content) -> str | None:
    """A message's content as the chat template would see it: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [part.get("text") for part in content if isinstance(part, dict)]
        if all(isinstance(part, str) for part in parts):
            return "".join(parts)
    return None


def _chat_messages(path: str, request: dict) -> list[dict] | None:
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    out = []
    system = request.get("system") if path == "/v1/messages" else None  # Anthropic: system is its own field
    if system is not None:
        text = _text(system)
        if text is None:
            return None
        out.append({"role": "system", "content": text})
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return None
        text = _text(message.get("content"))
        if text is None:
            return None
        out.append({"role": message["role"], "content": text})
    return out


def routing_prompt(tokenizer, path: str, body: bytes) -> tuple[list[int], str] | None:
    """The prompt's token ids and text as the replica's engine will see them, or None when the
    request has no plain prompt to match (the router then routes by load alone).

    A chat request is rendered with the model's chat template as it stands: tools and
    chat_template_kwargs are left out, which can shorten the matched prefix but never changes
    an answer (routing only picks the replica)."""
    if path not in PREFIX_ROUTED_PATHS:
        return None
    try:
        request = json.loads(body)
        if not isinstance(request, dict):
            return None
        if path == "/v1/completions":
            prompt = request.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, str):
                return list(tokenizer.encode(prompt)), prompt
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return list(prompt), ""
            return None
        messages = _chat_messages(path, request)
        if messages is None:
            return None
        return list(tokenizer.encode_chat(messages)), tokenizer.apply_chat_template(messages)
    except Exception:  # noqa: BLE001 - a request the template or tokenizer refuses is routed by load; the replica answers it
        return None


def routing_key(tokenizer, block_size: int, path: str, body: bytes) -> tuple[tuple[BlockHash, ...], str]:
    """(block hashes of the prompt's full blocks, prompt text); empty when there is no prompt."""
    found = routing_prompt(tokenizer, path, body)
    if found is None:
        return (), ""
    token_ids, text = found
    return tuple(prefix_block_hashes(token_ids, block_size)), text


class PrefixRoutingPolicy:
    """Picks replicas for a request from what each replica holds in its prefix cache.

    Two sources say what a replica holds:
    - its own report (the block hashes in its prefix cache, sent as Ray Serve routing stats
      every few seconds), which accounts for evictions and restarts;
    - the requests routed to it since, which the report cannot show yet.

    A request goes to the replica holding the longest run of its leading blocks, among replicas
    whose ongoing requests are within `imbalance_threshold` of the least loaded. When the loads
    differ by more than that, it falls back to power of two choices (the less loaded of two
    random replicas). A request that matches nowhere goes to the least loaded replica, then the
    one holding the fewest blocks, so distinct prefixes spread over the replicas.
    """

    def __init__(self, imbalance_threshold: int = DEFAULT_IMBALANCE, report_margin_s: float = 10.0,
                 max_routed_blocks: int = 65536, rng: random.Random | None = None, clock=time.time):
        if imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be >= 0, got {imbalance_threshold}")
        self.imbalance_threshold = imbalance_threshold
        self.report_margin_s = report_margin_s  # routed blocks younger than (report time - margin) are kept
        self.max_routed_blocks = max_routed_blocks
        self._rng = rng or random.Random()
        self._clock = clock
        self._reported: dict[Hashable, tuple[float, frozenset]] = {}
        self._routed: dict[Hashable, OrderedDict] = {}
        self._ongoing: Counter = Counter()

    # ---- what the replicas hold and carry ------------------------------------------------
    def report(self, replica: Hashable, at: float, hashes: Sequence[BlockHash]) -> None:
        """A replica's own list of cached block hashes, taken at time `at` (newer ones win)."""
        previous = self._reported.get(replica)
        if previous is not None and previous[0] >= at:
            return
        self._reported[replica] = (at, frozenset(hashes))
        routed = self._routed.get(replica)
        if routed:
            cutoff = at - self.report_margin_s
            while routed and next(iter(routed.values())) < cutoff:
                routed.popitem(last=False)

    def routed(self, replica: Hashable, hashes: Sequence[BlockHash]) -> None:
        """A request with these block hashes was sent to `replica`."""
        self._ongoing[replica] += 1
        if not hashes:
            return
        routed = self._routed.setdefault(replica, OrderedDict())
        now = self._clock()
        for block_hash in hashes:
            routed[block_hash] = now
            routed.move_to_end(block_hash)
        while len(routed) > self.max_routed_blocks:
            routed.popitem(last=False)

    def completed(self, replica: Hashable) -> None:
        if self._ongoing[replica] > 0:
            self._ongoing[replica] -= 1

    def forget(self, replica: Hashable) -> None:
        """The replica died: nothing it held survives."""
        self._reported.pop(replica, None)
        self._routed.pop(replica, None)
        self._ongoing.pop(replica, None)

    def ongoing(self, replica: Hashable) -> int:
        return self._ongoing[replica]

    def matched_blocks(self, replica: Hashable, hashes: Sequence[BlockHash]) -> int:
        """How many of the request's leading blocks the replica holds."""
        reported = self._reported.get(replica, (0.0, frozenset()))[1]
        routed = self._routed.get(replica) or {}
        count = 0
        for block_hash in hashes:
            if block_hash not in reported and block_hash not in routed:
                break
            count += 1
        return count

    def held_blocks(self, replica: Hashable) -> int:
        return len(self._reported.get(replica, (0.0, frozenset()))[1]) + len(self._routed.get(replica) or ())

    # ---- the choice -------------------------------------------------------------------------
    def rank(self, candidates: Sequence[Hashable], hashes: Sequence[BlockHash]) -> list[list]:
        """Candidates in ranks, most preferred first (Ray Serve tries rank by rank)."""
        candidates = list(candidates)
        if len(candidates) <= 1:
            return [candidates] if candidates else []
        loads = [self._ongoing[r] for r in candidates]
        if max(loads) - min(loads) > self.imbalance_threshold:
            return self.power_of_two(candidates)
        scores = {r: self.matched_blocks(r, hashes) for r in candidates} if hashes else dict.fromkeys(candidates, 0)
        tie = {r: self._rng.random() for r in candidates}
        ordered = sorted(candidates, key=lambda r: (-scores[r], self._ongoing[r], self.held_blocks(r), tie[r]))
        return [[r] for r in ordered]

    def power_of_two(self, candidates: Sequence[Hashable]) -> list[list]:
        pair = self._rng.sample(list(candidates), 2)
        pair.sort(key=lambda r: self._ongoing[r])
        return [[pair[0]], [pair[1]]]

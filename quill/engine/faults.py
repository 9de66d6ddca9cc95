"""Fault injection: make one request fail at one phase of the engine, on purpose.

Fault isolation is a property that can only be tested by breaking things. A FaultPlan belongs
to one engine (no process-wide state); it is empty unless a test, or `quill serve
--enable-fault-injection` through the `X-Quill-Fault: PHASE` header, arms a request. Arming
an unknown phase is an error that names the phases.
"""

from __future__ import annotations

FAULT_PHASES = ("queued", "prefill", "forward", "decode", "sample", "grammar", "detokenize", "stop")
"""Where a request can be made to fail:

queued      while it waits for admission (before any of its tokens is computed)
prefill     while its prompt chunk is prepared for the forward pass
forward     inside the forward pass itself (a kernel failure: the whole batch's pass fails)
decode      while its decode row is prepared
sample      while its next token is sampled
grammar     while its grammar mask is applied or its matcher advances
detokenize  while its new token is turned into text
stop        while its stop conditions are checked
"""


class InjectedFault(RuntimeError):
    """Raised where a FaultPlan says a request must fail."""


class FaultPlan:
    """request id -> the phase at which that request fails (each fires every time it is reached)."""

    def __init__(self) -> None:
        self._armed: dict[str, str] = {}

    def arm(self, request_id: str, phase: str) -> None:
        if phase not in FAULT_PHASES:
            raise ValueError(f"unknown fault phase {phase!r}; the phases are {', '.join(FAULT_PHASES)}")
        self._armed[request_id] = phase

    def disarm(self, request_id: str) -> None:
        self._armed.pop(request_id, None)

    def __bool__(self) -> bool:
        return bool(self._armed)

    def check(self, phase: str, request_id: str) -> None:
        """Raise InjectedFault if `request_id` is armed for `phase`."""
        if self._armed and self._armed.get(request_id) == phase:
            raise InjectedFault(f"injected fault at phase {phase!r} for request {request_id!r}")

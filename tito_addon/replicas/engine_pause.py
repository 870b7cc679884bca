"""An engine's pause around a weight update, as vLLM and sglang hold it (../shared/docs/weight-updates.md).

Both engines queue a request that arrives while paused until the resume. What a pause does to the generations in
flight depends on its mode: `abort` ends each at once with the tokens it has (vLLM `finish_reason: "abort"`, sglang
`{"type": "abort"}`), `wait` (vLLM) lets them run to their end, `keep` (vLLM), `in_place` and `retract` (sglang) freeze
them until the resume, with nothing visible to the client. Every token is stamped with the weight label current when
it was sampled, which is what vLLM (0.32+) and sglang (0.5.20+) report as `weight_versions` spans.

A replica's generation asks `step` before each token, so a pause or an abort takes effect between two tokens; it sets
the pace with its own per-token delay (without one, a whole generation runs between two checks of the event loop and
nothing can cut it). An aborted generation's planned output is kept, so a request that resubmits its prompt plus the
partial output continues exactly where it was cut: a deterministic model would, and a test can then compare the
stitched turn with an uncut one token for token.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

ABORT_MODES = frozenset({"abort"})
HOLD_MODES = frozenset({"keep", "in_place", "retract"})
PAUSE_MODES = ABORT_MODES | HOLD_MODES | {"wait"}
_KEPT_PLANS = 1024


@dataclass
class Generation:
    """One request in flight: the label of each token it sampled, and whether it was cut."""

    rid: str
    labels: list[str] = field(default_factory=list)
    aborted: bool = False


def spans_of(labels: list[str]) -> list[dict[str, Any]]:
    """`[{version, start, end}]` over the tokens, a span for each run of one label (half-open, as both engines)."""
    spans: list[dict[str, Any]] = []
    for index, label in enumerate(labels):
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": label, "start": index, "end": index + 1})
    return spans


class EnginePause:
    """The pause state of one replica's engine, its generations in flight and the plans of those it cut."""

    def __init__(self) -> None:
        self.mode: str | None = None
        self._running = asyncio.Event()
        self._running.set()
        self._changed = asyncio.Event()
        self.in_flight: dict[str, Generation] = {}
        self.aborted = 0  # generations cut by a pause or an abort
        self.held = 0  # requests that arrived while paused and waited for the resume
        self._plans: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
        # A test's knob: a generation that has sampled this many tokens samples no more until the next pause, so a
        # trainer's abort cuts it exactly there however loaded the machine (a real engine keeps sampling meanwhile,
        # and so the cut lands a few tokens later; tests that need the place exactly set this).
        self.stall_at: int | None = None
        self._unstalled = asyncio.Event()

    @property
    def paused(self) -> bool:
        return self.mode is not None

    async def admit(self, rid: str) -> Generation:
        """A new request: queued while the engine is paused, then in flight."""
        if self.paused:
            self.held += 1
        await self._running.wait()
        generation = Generation(rid)
        self.in_flight[rid] = generation
        return generation

    async def step(self, generation: Generation, label: str) -> bool:
        """Before each token: False once the generation was aborted; a holding pause waits here for the resume.
        `label` is the weight label the token is sampled with (read after any wait: an update may have run)."""
        while not generation.aborted and (self.mode in HOLD_MODES or self._stalls(generation)):
            if self.mode in HOLD_MODES:
                await self._running.wait()
            else:
                self._unstalled.clear()
                await self._unstalled.wait()
        if generation.aborted:
            return False
        generation.labels.append(label)
        return True

    def _stalls(self, generation: Generation) -> bool:
        return self.stall_at is not None and len(generation.labels) >= self.stall_at

    def finish(self, generation: Generation) -> None:
        self.in_flight.pop(generation.rid, None)
        self._changed.set()

    def abort(self, prefix: str = "", *, exact: frozenset[str] | None = None) -> int:
        """Abort the generations in flight whose request id starts with `prefix` (sglang matches ids by prefix),
        every one for the empty prefix, or with `exact` those whose id is one of it (vLLM). How many were cut."""
        cut = 0
        for generation in self.in_flight.values():
            named = generation.rid in exact if exact is not None else generation.rid.startswith(prefix)
            if not generation.aborted and named:
                generation.aborted = True
                cut += 1
        self.aborted += cut
        return cut

    async def pause(self, mode: str) -> None:
        """Pause in `mode`; returns once the pause holds (an abort's generations ended, a `wait` drained)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}")
        self.mode = mode
        self._running.clear()
        if mode in ABORT_MODES:
            self.abort()
        self.stall_at = None  # (once: the resumed generation samples on)
        self._unstalled.set()
        if mode in ABORT_MODES or mode == "wait":
            while self.in_flight:
                self._changed.clear()
                await self._changed.wait()

    def resume(self) -> None:
        self.mode = None
        self._running.set()
        self.stall_at = None
        self._unstalled.set()

    # ------------------------------------------------------------------ continuing a cut generation
    def remember(self, prompt_ids: list[int], planned: list[int]) -> None:
        """An aborted generation's whole planned output, under the prompt it was first asked with (a continuation's
        root), so a resubmission of that prompt plus any prefix of the output continues it."""
        self._plans[tuple(prompt_ids)] = planned
        while len(self._plans) > _KEPT_PLANS:
            self._plans.popitem(last=False)

    def continuation(self, prompt_ids: list[int]) -> tuple[list[int], int] | None:
        """`(rest, offset)` when `prompt_ids` is a cut generation's prompt plus the first `offset` tokens it planned."""
        for prompt, planned in reversed(self._plans.items()):
            offset = len(prompt_ids) - len(prompt)
            if 0 <= offset <= len(planned) and tuple(prompt_ids[: len(prompt)]) == prompt:
                if prompt_ids[len(prompt) :] == planned[:offset]:
                    return planned[offset:], offset
        return None

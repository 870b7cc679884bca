"""One generation cut by weight updates, resumed until it really ends: its attempts laid end to end.

When a trainer pauses an engine in `abort` mode to load new weights, every generation in flight ends with the tokens
it has (vLLM `finish_reason: "abort"`, sglang `{"type": "abort"}` with no error status: ../shared/docs/weight-updates.md
§1.2, §2.3). We hold the exact ids, so the generation goes on as a new engine request on `prompt + partial`, with the
token budget less what was already sampled; the engine queues it until the resume. The attempts' ids and log-probs
are concatenated, each attempt's weight-version spans are shifted by the tokens before it, and the turn is answered,
parsed and recorded once, over the whole completion.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tito_addon.backends.backend_protocol import weight_version_of
from tito_addon.backends.expert_routes import Reader, RoutesAsked, RoutesRead, TurnRoutes, answered_routes
from tito_addon.tito_errors import TitoError

ABORT = "abort"


class GenerationCut(TitoError):
    """A generation cut more often, or for longer, than the proxy's resumption bounds allow."""

    status = 503
    error_type = "generation_cut"


@dataclass(frozen=True)
class ResumePolicy:
    """How far a cut generation is resumed: `max_resumptions` engine requests after the first, and no new one once
    `wait_s` have passed since the first cut (0 resumptions: a cut turn is answered with the error at once)."""

    max_resumptions: int = 20
    wait_s: float = 900.0


DEFAULT_RESUME = ResumePolicy()


@dataclass
class ResumeStats:
    """This process's generations that a weight update cut (or an engine's death, mid-stream: `engine_failover`):
    those resuming now (cut and not ended: held by the paused engine, or generating again), those that ended after
    being resumed, and every cut. A driver reads them from the control API's `/v1/info` to see an update drain."""

    resuming: int = 0
    resumed: int = 0
    cuts: int = 0


@dataclass
class Attempt:
    """What one engine request of the generation gave: its tokens, their log-probs (and the backend's own log-prob
    entries, for a reply that carries them), the weight-version spans it reported."""

    ids: list[int]
    logprobs: list[float]
    spans: list[dict[str, Any]] | None
    entries: list[Any] = field(default_factory=list)


@dataclass
class StitchedGeneration:
    """The attempts so far of one generation; `cuts` are the completion offsets where an attempt was aborted."""

    prompt_ids: list[int]
    policy: ResumePolicy
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entries: list[Any] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    cuts: list[int] = field(default_factory=list)
    first_cut_at: float | None = None
    stats: ResumeStats | None = None
    ended: bool = False
    routes: TurnRoutes | None = None  # when the turn asks for its MoE routes: each attempt's, laid end to end

    @property
    def routes_start(self) -> int | None:
        """Where the next attempt's routes are asked from (the position after the last row so far); None when the turn
        asks for none, or a gap ended them."""
        if self.routes is None or self.routes.missing is not None:
            return None
        return self.routes.end

    def add_routes(self, read: RoutesRead) -> None:
        """An attempt's routes, read before it is added (`add`, `cut`)."""
        if self.routes is not None:
            self.routes.add(read, resumed=bool(self.attempts))

    def read_routes(self, read: Reader, text: Any, sampled: int, aborted: bool = False) -> None:
        """The routes of the attempt under way (its prompt: `attempt_prompt`), which sampled `sampled` tokens, from
        the backend's answer `text`; before the attempt is added."""
        start = self.routes_start
        if self.routes is not None and start is not None:
            asked = RoutesAsked(start, self.routes.asked.shape)
            self.add_routes(answered_routes(read, text, asked, len(self.attempt_prompt()), sampled, aborted))

    @property
    def resumed(self) -> bool:
        return bool(self.cuts)

    def attempt_prompt(self) -> list[int]:
        """The ids the next attempt generates from: the turn's prompt and everything sampled so far."""
        return self.prompt_ids + self.ids if self.ids else self.prompt_ids

    def add(self, attempt: Attempt) -> None:
        self.attempts.append(attempt)
        self.ids += attempt.ids
        self.logprobs += attempt.logprobs
        self.entries += attempt.entries

    def cut(self, attempt: Attempt) -> None:
        """An attempt that ended aborted: kept, and the next allowed (else `GenerationCut`)."""
        if self.stats is not None:
            self.stats.resuming += not self.cuts
            self.stats.cuts += 1
        self.add(attempt)
        self.cuts.append(len(self.ids))
        now = time.monotonic()
        if self.first_cut_at is None:
            self.first_cut_at = now
        if len(self.cuts) > self.policy.max_resumptions:
            raise GenerationCut(
                f"the backend aborted this generation {len(self.cuts)} times (a weight update each time, or an "
                f"abort request) and tito_resume_max is {self.policy.max_resumptions}: nothing was recorded"
            )
        if now - self.first_cut_at > self.policy.wait_s:
            raise GenerationCut(
                f"the backend kept aborting this generation for {now - self.first_cut_at:.0f} s, longer than "
                f"tito_resume_wait ({self.policy.wait_s:g} s): nothing was recorded"
            )

    def end(self, finished: bool) -> None:
        """The generation is over: `finished` when it reached its end (else it failed, or its agent left)."""
        if self.stats is not None and self.cuts and not self.ended:
            self.stats.resuming -= 1
            self.stats.resumed += finished
        self.ended = True

    def left_of(self, budget: Any) -> Any:
        """A token budget (max_tokens, min_tokens) less what was already sampled; None stays None."""
        if type(budget) is not int:
            return budget
        return max(budget - len(self.ids), 0)

    def spans(self, final: list[dict[str, Any]] | None = None) -> list[dict[str, Any]] | None:
        """Every attempt's spans, shifted by the tokens before it, the same version's neighbours merged; an attempt
        that reported none covers its tokens with a null version (nothing is invented). None when no attempt said."""
        merged: list[dict[str, Any]] = []
        offset = 0
        said = False
        for attempt in self.attempts:
            count = len(attempt.ids)
            pieces: list[dict[str, Any]] = attempt.spans or [{"version": None, "start": 0, "end": count}]
            said = said or bool(attempt.spans)
            for span in pieces:
                start, end = offset + span["start"], offset + span["end"]
                if start >= end:
                    continue
                if merged and merged[-1]["version"] == span["version"] and merged[-1]["end"] == start:
                    merged[-1]["end"] = end
                else:
                    merged.append({"version": span["version"], "start": start, "end": end})
            offset += count
        return merged if said else None

    def record(self) -> dict[str, Any] | None:
        """What the turn's record says of its attempts: None when the generation was never cut."""
        if not self.cuts:
            return None
        return {"attempts": len(self.attempts), "cuts": list(self.cuts)}

    def stop_cut(self, stops: list[str], decode: Callable[[list[int]], str]) -> tuple[int, str] | None:
        """Where a stop string that straddles a cut ends, in tokens, and which: each engine request checked its stop
        strings over its own output only, so one that began before a cut and ended after it went unseen. None when
        none did."""
        if not self.cuts:
            return None
        return _fewest_holding(self.ids, [], [s for s in stops if s], decode)

    def stop_within(
        self, ids: list[int], stops: list[str], decode: Callable[[list[int]], str]
    ) -> tuple[int, str] | None:
        """For an attempt under way after a cut, whose tokens so far are `ids`: how many of them to keep, and the stop
        string, when one that began before the cut ends among them (the engine checks only the attempt's own output).
        Only a window of the tokens before the cut is decoded, wide enough for the longest stop string."""
        stops = [s for s in stops if s]
        if not stops or not self.ids:
            return None
        span = 4 * max(map(len, stops)) + 8  # tokens: more than any stop string's (a token is a byte or more)
        # One that began before the cut ends within `span` tokens of it.
        return _fewest_holding(ids[:span], self.ids[-span:], stops, decode)

    def truncate(self, count: int) -> None:
        """Keep the first `count` tokens (a stop string ended there): later attempts' tokens past it are dropped."""
        kept = 0
        for attempt in self.attempts:
            take = max(min(len(attempt.ids), count - kept), 0)
            if take < len(attempt.ids):
                attempt.ids, attempt.logprobs, attempt.entries = attempt.ids[:take], attempt.logprobs[:take], []
                if attempt.spans:
                    attempt.spans = [
                        {**s, "end": min(s["end"], take)} for s in attempt.spans if s["start"] < take
                    ] or None
            kept += take
        self.ids, self.logprobs, self.entries = self.ids[:count], self.logprobs[:count], self.entries[:count]
        self.cuts = [c for c in self.cuts if c < count]
        if self.routes is not None:  # the last kept token has no route of this turn's
            self.routes.truncate(len(self.prompt_ids) + count - 1)


def attempt_spans(value: Any, count: int) -> list[dict[str, Any]] | None:
    """One attempt's `weight_versions` (vLLM 0.32+, sglang 0.5.20+), when they are well formed and tile its `count`
    tokens; else None (its tokens are then recorded with no version)."""
    if not isinstance(value, list) or not value or count == 0:
        return None
    spans = []
    for span in value:
        if not isinstance(span, dict):
            return None
        version, start, end = weight_version_of(span.get("version")), span.get("start"), span.get("end")
        if version is None or type(start) is not int or type(end) is not int or not 0 <= start < end <= count:
            return None
        spans.append({"version": version, "start": start, "end": end})
    if spans[0]["start"] != 0 or spans[-1]["end"] != count:
        return None
    if any(a["end"] != b["start"] for a, b in zip(spans, spans[1:], strict=False)):
        return None
    return spans


def stop_list(value: Any) -> list[str]:
    """A request's `stop` (a string or a list of them) as a list of its non-empty strings."""
    if isinstance(value, str):
        return [value] if value else []
    return [s for s in value if isinstance(s, str) and s] if isinstance(value, list) else []


def first_stop(text: str, stops: list[str]) -> str | None:
    """The stop string that occurs first in `text`, if any does."""
    return min((s for s in stops if s in text), key=text.find, default=None)


def _fewest_holding(
    ids: list[int], before: list[int], stops: list[str], decode: Callable[[list[int]], str]
) -> tuple[int, str] | None:
    """The fewest of `ids` whose text, after `before`'s, holds a stop string, and that string; None when all of them
    hold none. A binary search: the text only grows with the tokens."""
    if not stops or not ids or first_stop(decode(before + ids), stops) is None:
        return None
    low, high = 1, len(ids)
    while low < high:
        middle = (low + high) // 2
        if first_stop(decode(before + ids[:middle]), stops) is not None:
            high = middle
        else:
            low = middle + 1
    found = first_stop(decode(before + ids[:low]), stops)
    assert found is not None
    return low, found


def recorded_spans(spans: list[dict[str, Any]] | None) -> tuple[str | None, list[dict[str, Any]] | None]:
    """A turn's weight version (its last token's) and, when more than one version sampled it, its spans: as
    `backend_protocol.weight_spans_of` records a single engine request's."""
    if not spans:
        return None, None
    changed = len({span["version"] for span in spans}) > 1
    return spans[-1]["version"], spans if changed else None


def fresh_request_id() -> str:
    """An engine request id for a resumed attempt, random: sglang aborts every request whose id starts with the one it
    was asked to abort, so ids made by counting (`turn-1` next to `turn-10`) would be cut together."""
    return uuid.uuid4().hex

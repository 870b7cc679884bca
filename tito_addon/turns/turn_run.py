"""A claimed turn in flight, whole or streamed: the same steps whichever responder answers the agent.

The turn service starts it (claim, responder); the backend's result is committed and described here, and the claim
released however the turn ends. A whole reply and a live stream (`live_stream`) differ only in how they carry the
outcome to the agent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tito_addon.backends.backend_protocol import BackendResult, BackendTurn
from tito_addon.engine.token_engine import TokenEngine
from tito_addon.protocols.agent_api import Responder, TurnOutcome
from tito_addon.sessions.session_space import Claim
from tito_addon.turns.session_records import SessionRecords
from tito_addon.turns.turn_record import CompletedTurn, completed_turn
from tito_addon.turns.turn_replies import matched_stop
from tito_addon.turns.turn_types import PreparedTurn


@dataclass(frozen=True, slots=True)
class LineContext:
    """What a turn's record line takes from the service and the agent's request beside the turn itself."""

    engine: TokenEngine
    backend_kind: str
    request_id: str | None
    record_message_text: bool


@dataclass
class TurnsInFlight:
    """This process's turns between their claim and its release, with when each began: during a weight update's
    pause they are the turns the paused engines hold (the proxy cannot see inside an engine; a driver that paused it
    can), and a driver sees the update drain as they end."""

    began: dict[int, float] = field(default_factory=dict)

    def add(self, run: TurnRun) -> None:
        self.began[id(run)] = time.monotonic()

    def discard(self, run: TurnRun) -> None:
        self.began.pop(id(run), None)

    def summary(self) -> dict[str, Any]:
        """`{count, oldest_s}`: how many, and how long the oldest has waited (null when none)."""
        oldest = min(self.began.values(), default=None)
        return {"count": len(self.began), "oldest_s": None if oldest is None else round(time.monotonic() - oldest, 3)}


@dataclass
class TurnRun:
    prepared: PreparedTurn
    claim: Claim
    responder: Responder
    backend_turn: BackendTurn
    sessions: SessionRecords
    line: LineContext
    budget: dict | None = None  # the completion budget as cut to the backend's context, when it was
    released: bool = False
    in_flight: TurnsInFlight | None = None  # the process's count this run is in until it is released

    def completed(self, result: BackendResult, session_id: str, turn_id: int) -> CompletedTurn:
        """The turn's record line for the backend's result, once the sessions settled its session and turn id."""
        line = self.line
        return completed_turn(
            self.prepared,
            result,
            line.engine,
            line.backend_kind,
            session_id=session_id,
            turn_id=turn_id,
            request_id=line.request_id,
            reply_id=self.responder.reply_id,
            record_message_text=line.record_message_text,
            completion_budget=self.budget,
        )

    async def finish(self, result: BackendResult) -> tuple[dict[str, Any], TurnOutcome]:
        """Commit a turn the backend completed; the flow metadata that describes it, and what the agent gets."""
        prepared = self.prepared
        result.message = self.responder.adapt(result.message)
        failover = self.backend_turn.failover
        result.extra["engine"], result.extra["failover"] = failover.engine, failover.record()
        node, done = await self.sessions.commit(self.claim, partial(self.completed, result), prepared.link_scope)
        prepared.prompt.remember(node, result.completion_ids)
        if node.parent is None:
            # A new tree may have taken the sessions past their capacity; idle ones were swept as the turn began.
            await self.sessions.sweep_inline()
        metadata = {
            "session_id": node.session.session_id,
            "turn_id": node.turn_id,
            "parent_turn_id": node.parent.turn_id if node.parent else None,
            "prompt_tokens": len(prepared.prompt),
            "completion_tokens": len(result.completion_ids),
            # The whole record line: a `-w` flow file is then enough to regenerate the trajectory (`-r`).
            "record": done.fields,
        }
        tito_headers = {"x-tito-session-id": metadata["session_id"], "x-tito-turn-id": str(metadata["turn_id"])}
        outcome = TurnOutcome(
            message=result.message,
            finish_reason=result.finish_reason,
            prompt_tokens=len(prepared.prompt),
            completion_tokens=len(result.completion_ids),
            agent_body=result.agent_body,
            agent_bytes=result.agent_bytes,
            matched_stop=matched_stop(result.agent_body),
            headers=tito_headers,
            reasoning_tokens=done.fields.get("reasoning_tokens") or 0,
        )
        return metadata, outcome

    async def release(self) -> None:
        """The turn is over, committed or not: its claim no longer holds its session in flight."""
        if not self.released:
            self.released = True
            if self.in_flight is not None:
                self.in_flight.discard(self)
            await self.sessions.release(self.claim)

"""A claimed turn in flight, whole or streamed: the same steps whichever responder answers the agent.

The turn service starts it (claim, responder); the backend's result is committed and described here, and the claim
released however the turn ends. A whole reply and a live stream (`live_stream`) differ only in how they carry the
outcome to the agent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tito_addon.backends.backend_protocol import BackendResult, BackendTurn
from tito_addon.protocols.agent_api import Responder, TurnOutcome
from tito_addon.sessions.session_space import Claim
from tito_addon.turns.session_records import SessionRecords
from tito_addon.turns.turn_record import CompletedTurn
from tito_addon.turns.turn_replies import matched_stop
from tito_addon.turns.turn_types import PreparedTurn


@dataclass
class TurnRun:
    prepared: PreparedTurn
    claim: Claim
    responder: Responder
    backend_turn: BackendTurn
    sessions: SessionRecords
    # The turn's record line for the backend's result and its cut budget, once its session and turn id are settled.
    record: Callable[[BackendResult, dict | None, str, int], CompletedTurn]
    budget: dict | None = None  # the completion budget as cut to the backend's context, when it was
    released: bool = False

    async def finish(self, result: BackendResult) -> tuple[dict[str, Any], TurnOutcome]:
        """Commit a turn the backend completed; the flow metadata that describes it, and what the agent gets."""
        prepared = self.prepared
        result.message = self.responder.adapt(result.message)
        budget = self.budget
        node, done = await self.sessions.commit(
            self.claim, lambda sid, turn: self.record(result, budget, sid, turn), prepared.link_scope
        )
        prepared.prompt.remember(node, result.completion_ids)
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
            await self.sessions.release(self.claim)

"""The turn service's side of a shared session store (Redis): locate, claim, commit, resume and close there.

Order of a turn: locate (one lookup) -> claim its session and turn id, marked in flight (one script) -> backend ->
record line on disk -> commit (one script) -> answer. The line is on disk before Redis knows the turn, so a turn any
agent can extend is always on disk; a proxy that dies between the two leaves a line no agent was answered for (a leaf
no other turn extends). A commit Redis refuses is withdrawn on disk (a later line says so) before the agent gets its
error; one whose outcome is unknown (the connection failed) is settled when Redis answers again: withdrawn unless
Redis holds it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tito_addon.backends.backend_protocol import BackendResult
from tito_addon.protocols.openai_responses import reply_session
from tito_addon.records.record_reader import RecordError, read_session
from tito_addon.records.stored_turns import stored_nodes
from tito_addon.records.trajectory_recorder import TrajectoryRecorder
from tito_addon.sessions.redis_tree import SessionGone, StoreUnavailable, reasoning_digest
from tito_addon.sessions.session_ids import session_id_problem
from tito_addon.sessions.session_tree import Attachment, Session, TurnNode
from tito_addon.sessions.shared_sessions import SharedNode, SharedSessions
from tito_addon.tito_errors import BadRequest, SessionClosed, TitoError
from tito_addon.turns.turn_record import CompletedTurn

if TYPE_CHECKING:
    from tito_addon.turns.turn_service import ParsedRequest, PreparedTurn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claim:
    """The session and turn id a running turn will be committed as."""

    session: Session
    turn_id: int


class SharedTurns:
    def __init__(
        self, sessions: SharedSessions, recorder: TrajectoryRecorder | None, after_close: str = "refuse"
    ) -> None:
        self.sessions = sessions
        self.recorder = recorder
        self.after_close = after_close  # a name its driver closed: refused, or a `new` tree under that name
        self.unsettled: list[tuple[str, int]] = []  # (session, turn) written whose commit's outcome is unknown

    async def locate(self, parsed: ParsedRequest) -> tuple[Attachment, bytes]:
        messages = parsed.agent.chat.messages
        roles = [m.role for m in messages]
        digests = [reasoning_digest(r) or None for r in parsed.reasonings]
        located = await self.sessions.locate(parsed.session_id, parsed.keys, digests, roles, parsed.namespace)
        if parsed.session_id is not None and located.state == "2":  # closed by its driver: never resumed
            if self.after_close == "refuse":
                raise SessionClosed(parsed.session_id)
        elif parsed.session_id is not None and located.state != "0" and await self.restore(parsed.session_id):
            located = await self.sessions.locate(parsed.session_id, parsed.keys, digests, roles, parsed.namespace)
        return located.attachment, located.request_path

    async def continued(self, reply_id: str, session_id: str | None) -> Attachment:
        node = await self.sessions.reply_turn(reply_id)
        if node is None:
            named = reply_session(reply_id)
            if named is not None and session_id_problem(named) is None and await self.restore(named):
                node = await self.sessions.reply_turn(reply_id)
        return attach_to_reply(node, reply_id, session_id)

    async def claim(self, prepared: PreparedTurn) -> Claim:
        attached = prepared.attachment.session
        if prepared.session_id is not None:
            sid, automatic, namespace = prepared.session_id, False, ""
        elif attached is not None:
            sid, automatic, namespace = attached.session_id, attached.automatic, attached.namespace
        else:  # a first request: its GRPO group's session, whichever proxy claimed that prompt first
            sid, automatic, namespace = None, True, prepared.namespace
        session, turn = await self.sessions.claim(
            sid, automatic, namespace, prepared.request_path, prepared.new_session_id, prepared.parent,
            reopen_closed=self.after_close == "new",
        )  # fmt: skip
        return Claim(session, turn)

    async def commit(
        self, prepared: PreparedTurn, done: CompletedTurn, result: BackendResult, claim: Claim
    ) -> SharedNode:
        if self.recorder is not None:
            self.recorder.write_turn_line(done.session_id, done.fields)
        parent = prepared.parent
        assert parent is None or isinstance(parent, SharedNode)
        try:
            node = await self.sessions.commit(
                claim.session, claim.turn_id, parent, done.message_end(parent), done.segment_keys,
                reasoning_digest(done.assistant_reasoning) or None, prepared.piece.ids, result.completion_ids,
                result.finish_reason, done.tools_sha256, prepared.kwargs, done.reply_id,
            )  # fmt: skip
        except SessionGone as error:  # refused by the store: certainly not committed
            self._withdraw(claim.session.session_id, claim.turn_id, error.message)
            raise
        except StoreUnavailable:
            # The commit may have reached Redis before the connection failed: which it was is settled once the
            # store answers again (`settle`); until then the line stands, as it must if Redis has the turn.
            self.unsettled.append((claim.session.session_id, claim.turn_id))
            raise
        prepared.prompt.remember(node, result.completion_ids)
        return node

    async def settle(self) -> None:
        """Withdraw on disk every turn whose commit failed and that Redis does not hold (no turn can extend it)."""
        while self.unsettled:
            sid, turn = self.unsettled[0]
            if await self.sessions.tree.node(sid, turn) is None:
                self._withdraw(sid, turn, "its commit to the session store failed; the agent got an error")
            self.unsettled.pop(0)

    def _withdraw(self, session_id: str, turn_id: int, reason: str) -> None:
        if self.recorder is None:
            return
        try:
            self.recorder.withdraw_turn(session_id, turn_id, reason)
        except OSError:
            logger.exception("could not withdraw turn %d of session %s", turn_id, session_id)

    async def restore(self, session_id: str) -> bool:
        """Put a named session that Redis does not hold (closed, or never there) back from its record files, all
        writers' parts together. False when there is nothing recorded."""
        if self.recorder is None:
            return False
        try:
            recorded = read_session(self.recorder.record_dir, session_id)
            if recorded is None or not recorded.turns:
                return False
            recorded.full_ids()  # proves every parent is present and every prompt length adds up
        except (OSError, RecordError) as exc:
            raise TitoError(f"cannot resume session from its record files: {exc}", status=409) from exc
        if recorded.closed_by_driver and self.after_close == "refuse":
            raise SessionClosed(session_id)
        nodes = stored_nodes(session_id, recorded.turns_since_driver_close())
        next_at_least = recorded.highest_turn_id + 1 + len(recorded.skipped_lines)
        if await self.sessions.restore(session_id, nodes, next_at_least):
            logger.info("tito: resumed session %s with %d recorded turns", session_id, len(nodes))
        return True

    async def sweep(self) -> None:
        """Settle failed commits, then close idle and excess sessions (each by one proxy), writing their close lines
        here."""
        await self.settle()
        for sid, turns, reason in await self.sessions.sweep():
            logger.info("tito: session %s closed (%s) after %d turns", sid, reason, turns)
            if self.recorder is None or turns == 0:
                continue
            try:
                self.recorder.close_session(sid, turns, reason)
            except OSError:
                logger.exception("could not close the record of session %s", sid)


def attach_to_reply(node: TurnNode | None, reply_id: str, session_id: str | None) -> Attachment:
    """Where a request naming a previous reply attaches: that reply's turn, in the session the request names."""
    if node is None:
        raise TitoError(f"previous response {reply_id!r} is not a turn this proxy has recorded", status=404)
    if session_id is not None and node.session.session_id != session_id:
        raise BadRequest(f"previous response {reply_id!r} belongs to another session than {session_id!r}")
    return Attachment(node.session, node, node.message_end)

"""The sessions and their records kept in step, wherever the sessions live (`SessionSpace`).

A turn's record line is written before its session's tree knows the turn, so a turn any agent can extend is always on
disk; a commit the sessions refuse after the line was written (the session closed meanwhile) is withdrawn on disk (a
later line says so) before the agent gets its error, and one whose outcome is unknown (the shared store's connection
failed) is settled when the store answers again: withdrawn unless the store holds it. A named session the sessions do
not hold comes back from its records; a session that closes gets its close line. The turn service, the control API
and the periodic sweep all go through here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tito_addon.protocols.openai_responses import reply_session
from tito_addon.records.record_models import TurnRecord
from tito_addon.records.record_reader import RecordError
from tito_addon.records.records_port import Records
from tito_addon.records.stored_turns import recorded_turns
from tito_addon.sessions.session_ids import session_id_problem
from tito_addon.sessions.session_space import (
    Claim,
    ClosedSession,
    Located,
    Lookup,
    SessionSpace,
    SessionState,
)
from tito_addon.sessions.session_tree import Attachment, TurnNode
from tito_addon.sessions.turn_entity import Turn
from tito_addon.tito_errors import (
    BadRequest,
    SessionClosed,
    SessionGone,
    StoreUnavailable,
    TitoError,
    UnknownReply,
)
from tito_addon.turns.episode_places import EpisodeLinks, interrupted_call
from tito_addon.turns.turn_record import CompletedTurn
from tito_addon.turns.turn_types import ParsedRequest, PreparedTurn

logger = logging.getLogger(__name__)


class SessionRecords:
    def __init__(self, sessions: SessionSpace, records: Records, after_close: str = "refuse") -> None:
        """`after_close`: what a request naming a session its driver closed gets: `refuse` (410) or a `new` tree."""
        self.sessions = sessions
        self.records = records
        self.after_close = after_close
        self.unsettled: list[tuple[str, int]] = []  # (session, turn) written whose commit's outcome is unknown
        # What later roots (a context rebuilt from a summary, a sub-agent) link to: fed by every commit and resume.
        self.links = EpisodeLinks(sessions.links)

    # -- where a turn goes --------------------------------------------------------------------------------------

    async def locate(self, parsed: ParsedRequest) -> Located:
        """Where a request attaches; a named session the sessions do not hold is put back from its records first."""
        named = parsed.session_id
        lookup = Lookup(named, parsed.agent.chat.messages, parsed.keys, parsed.reasonings, parsed.namespace)

        async def locate() -> Located:
            return await self.sessions.locate(lookup)

        located = await locate()
        if named is None or located.state is SessionState.LIVE:
            return located
        if located.state is SessionState.CLOSED_BY_DRIVER:
            if self.after_close == "refuse":
                raise SessionClosed(named)
            return located  # a new tree under the name: its claim reopens it, its ids continuing
        if await self.resume(named):
            located = await locate()
        return located

    async def continued(self, reply_id: str, session_id: str | None) -> Attachment:
        """Where a request that names a previous reply attaches: that reply's turn, found in the live sessions or,
        after a restart, in the record of the session the id names."""
        node = await self.sessions.reply_turn(reply_id)
        if node is None:
            named = reply_session(reply_id)
            if named is not None and session_id_problem(named) is None and await self.resume(named):
                node = await self.sessions.reply_turn(reply_id)
        return attach_to_reply(node, reply_id, session_id)

    async def claim(self, prepared: PreparedTurn) -> Claim:
        return await self.sessions.claim(prepared, reopen_closed=self.after_close == "new")

    async def commit(
        self, claim: Claim, build: Callable[[str, int], CompletedTurn], link_scope: str
    ) -> tuple[TurnNode, CompletedTurn]:
        """Commit a turn the backend completed: its line is written once the sessions settle its session and id
        (`build` makes it), then the tree takes the turn, and later roots of `link_scope` may link to it."""
        written: list[CompletedTurn] = []

        def record(session_id: str, turn_id: int) -> Turn:
            done = build(session_id, turn_id)
            self.records.append_turn(session_id, done.fields, done.routes, done.images)
            written.append(done)
            return done.turn

        try:
            node = await self.sessions.commit(claim, record)
        except (SessionGone, SessionClosed) as error:  # refused: certainly not committed
            if written:
                self._withdraw(written[0].session_id, written[0].turn_id, error.message)
            raise
        except StoreUnavailable:
            # The commit may have reached the store before the connection failed: which it was is settled once the
            # store answers again (`settle`); until then the line stands, as it must if the store has the turn.
            if written:
                self.unsettled.append((written[0].session_id, written[0].turn_id))
            raise
        await self._note(link_scope, written[0].fields, interrupted_call(node))
        return node, written[0]

    async def release(self, claim: Claim) -> None:
        await self.sessions.release(claim)

    # -- records of sessions ------------------------------------------------------------------------------------

    async def resume(self, session_id: str) -> bool:
        """Put a named session back from its record files (all writers' parts), so its turns extend the recorded ids
        and its turn ids continue instead of colliding. False when nothing is recorded."""
        try:
            recorded = self.records.read(session_id)
            if recorded is None or not (recorded.turns or recorded.skipped_lines):
                return False
            recorded.full_ids()  # proves every parent is present and every prompt length adds up
        except (OSError, RecordError) as exc:
            raise TitoError(f"cannot resume session from its record file: {exc}", status=409) from exc
        if recorded.closed_by_driver and self.after_close == "refuse":
            raise SessionClosed(session_id)
        turns = recorded.turns_since_driver_close()
        restored = recorded_turns(turns)
        # Never reuse the id of a turn left out (before its driver's close), nor of a torn line.
        next_turn_id = recorded.highest_turn_id + 1 + len(recorded.skipped_lines)
        if await self.sessions.restore(session_id, restored, next_turn_id):
            logger.info("tito: resumed session %s with %d recorded turns", session_id, len(restored))
            await self._note_recorded(session_id, turns)
        return True

    async def _note(self, scope: str, line: dict, resumes: str) -> None:
        """What later roots may link to; the turn stands if the store cannot take it (a later root it would have
        linked is then placed as the rules place an unlinked one, and says why)."""
        try:
            await self.links.note(scope, line, resumes)
        except StoreUnavailable as exc:
            where = f"{line['session_id']}/{line['turn_id']}"
            logger.warning("tito: turn %s committed, but what may link to it was not kept: %s", where, exc.message)

    async def _note_recorded(self, scope: str, turns: list[TurnRecord]) -> None:
        """What a resumed session's turns offer later roots, as their commits did."""
        calls = {turn.turn_id: (turn.call, turn.parent_turn_id) for turn in turns}
        for turn in turns:
            call, parent = turn.call, turn.parent_turn_id
            while call == "compaction" and parent is not None:
                call, parent = calls[parent]
            resumes = "main" if call == "compaction" else call
            line = {"session_id": turn.session_id, "turn_id": turn.turn_id, "episode": turn.episode_id,
                    "call": turn.call, "assistant_message": turn.assistant_message}  # fmt: skip
            await self._note(scope, line, resumes)

    async def settle(self) -> None:
        """Withdraw on disk every turn whose commit failed and that the store does not hold (no turn can extend
        it)."""
        while self.unsettled:
            sid, turn = self.unsettled[0]
            if not await self.sessions.holds(sid, turn):
                self._withdraw(sid, turn, "its commit to the session store failed; the agent got an error")
            self.unsettled.pop(0)

    async def sweep(self) -> None:
        """Settle failed commits, then close idle and excess sessions, writing their close lines."""
        await self.settle()
        self._closed(await self.sessions.sweep())

    async def sweep_inline(self) -> None:
        """Where sweeping costs nothing (this process's own sessions) every turn sweeps as it begins, and a turn that
        began a tree once more after its commit (a new session may have taken the sessions past their capacity); a
        shared store is swept only periodically."""
        if self.sessions.sweeps_inline:
            await self.sweep()

    def close_all(self, reason: str) -> None:
        self._closed(self.sessions.close_all(reason))

    def _closed(self, closed: list[ClosedSession]) -> None:
        for session in closed:
            logger.info(
                "tito: session %s closed (%s) after %d turns", session.session_id, session.reason, session.turns
            )
            if session.turns == 0:
                continue
            try:
                self.records.close(session.session_id, session.turns, session.reason)
            except OSError:
                logger.exception("could not close the record of session %s", session.session_id)

    def _withdraw(self, session_id: str, turn_id: int, reason: str) -> None:
        try:
            self.records.withdraw(session_id, turn_id, reason)
        except OSError:
            logger.exception("could not withdraw turn %d of session %s", turn_id, session_id)


def attach_to_reply(node: TurnNode | None, reply_id: str, session_id: str | None) -> Attachment:
    """Where a request naming a previous reply attaches: that reply's turn, in the session the request names."""
    if node is None:
        raise UnknownReply(reply_id)
    if session_id is not None and node.session.session_id != session_id:
        raise BadRequest(f"previous response {reply_id!r} belongs to another session than {session_id!r}")
    return Attachment(node.session, node, node.message_end)

"""The replay addon: serves recorded sessions to an unmodified agent with no backend running.

It runs before the capture addon: a chat request that matches a recorded turn is answered here; a miss is a 404
naming the closest recorded turn, or, with `tito_replay_fallback=live`, is left to the capture addon, which serves
it from the backend and records it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mitmproxy import ctx, exceptions, http

from tito_addon.protocols.routing import is_agent_path
from tito_addon.proxy.proxy_facts import ProxyFacts
from tito_addon.records.record_reader import RecordError
from tito_addon.records.replay_index import ReplayIndex
from tito_addon.tito_errors import TitoError
from tito_addon.turns.replay_turn import Miss, ReplayService

logger = logging.getLogger(__name__)


class TitoReplay:
    def __init__(self, facts: ProxyFacts | None = None) -> None:
        self.facts = facts if facts is not None else ProxyFacts()
        self.index: ReplayIndex | None = None
        self.service: ReplayService | None = None
        self.memo_bytes = 0  # what the service's memos were sized to

    def load(self, loader: Any) -> None:
        loader.add_option("tito_replay_dir", str, "", "Serve the sessions recorded in this directory (offline replay).")
        loader.add_option(
            "tito_replay_fallback", str, "404", "A request with no recorded match: 404, or live (serve and record it)."
        )

    def configure(self, updated: set[str]) -> None:
        if "tito_replay_fallback" in updated and ctx.options.tito_replay_fallback not in ("404", "live"):
            raise exceptions.OptionsError("tito_replay_fallback must be 404 or live")
        self.facts.replay_fallback_live = ctx.options.tito_replay_fallback == "live"
        self.facts.replaying = bool(ctx.options.tito_replay_dir)
        if "tito_replay_dir" not in updated:
            return
        directory = ctx.options.tito_replay_dir
        if not directory:
            self.index = self.service = None
            return
        try:
            self.index = ReplayIndex.load(Path(directory))
        except (RecordError, OSError, ValueError) as exc:
            raise exceptions.OptionsError(f"cannot replay {directory}: {exc}") from exc
        self.memo_bytes = self.facts.message_memo_bytes
        self.service = ReplayService(self.index, memo_bytes=self.memo_bytes)

    def _sized(self, service: ReplayService) -> ReplayService:
        """The service with its memos sized as the capture addon's option says now (it configures after this one)."""
        if self.memo_bytes != self.facts.message_memo_bytes:
            self.memo_bytes = self.facts.message_memo_bytes
            service.resize_memos(self.memo_bytes)
        return service

    def running(self) -> None:
        # Said once both options are final: mitmproxy's own line names only the placeholder reverse target.
        if self.index is None:
            return
        miss = (
            "served live by the backend and recorded"
            if ctx.options.tito_replay_fallback == "live"
            else "a 404 naming the closest recorded turn; no backend is contacted"
        )
        sessions = f"{self.index.sessions} session" + ("" if self.index.sessions == 1 else "s")
        logger.info(
            "tito: replaying %d recorded turns of %s from %s; a request with no recorded match: %s",
            self.index.turns,
            sessions,
            ctx.options.tito_replay_dir,
            miss,
        )

    def request(self, flow: http.HTTPFlow) -> None:
        if self.index is None or flow.response is not None or not flow.live:
            return
        if flow.request.method != "POST" or not is_agent_path(flow.request.path):
            return
        try:
            flow.response = self._answer(flow)
        except Exception:
            logger.exception("tito: replay failed")
            body = TitoError("internal error in tito_addon replay").body()
            flow.response = http.Response.make(500, body, {"content-type": "application/json"})

    def _answer(self, flow: http.HTTPFlow) -> http.Response | None:
        assert self.service is not None
        service = self._sized(self.service)
        try:
            body = flow.request.content or b""
        except ValueError:
            body = b"\xff"  # an undecodable content-encoding: parsed as invalid UTF-8, so a 400 in the agent's API
        answer = service.answer(flow.request.path, body)
        if answer is None:
            return None
        if isinstance(answer, Miss):
            if ctx.options.tito_replay_fallback == "live":
                return None  # the capture addon serves and records it
            answer = answer.reply()
        if answer.metadata:
            flow.metadata["tito"] = answer.metadata
        return http.Response.make(answer.status, answer.body, answer.headers)

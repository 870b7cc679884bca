"""The replay addon: serves recorded sessions to an unmodified agent with no backend running.

It runs before the capture addon: a chat request that matches a recorded turn is answered here; a miss is a 404
naming the closest recorded turn, or, with `tito_replay_fallback=live`, is left to the capture addon, which serves
it from the backend and records it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mitmproxy import ctx, exceptions, http

from tito_addon.protocols.openai_chat import SSE_HEADERS, is_chat_path, parse_body, sse_from_completion
from tito_addon.records.record_reader import RecordError
from tito_addon.records.replay_index import ReplayIndex, ReplayMiss, replay_completion
from tito_addon.tito_errors import TitoError

logger = logging.getLogger(__name__)


class TitoReplay:
    def __init__(self) -> None:
        self.index: ReplayIndex | None = None

    def load(self, loader: Any) -> None:
        loader.add_option("tito_replay_dir", str, "", "Serve the sessions recorded in this directory (offline replay).")
        loader.add_option(
            "tito_replay_fallback", str, "404", "A request with no recorded match: 404, or live (serve and record it)."
        )

    def configure(self, updated: set[str]) -> None:
        if "tito_replay_fallback" in updated and ctx.options.tito_replay_fallback not in ("404", "live"):
            raise exceptions.OptionsError("tito_replay_fallback must be 404 or live")
        if "tito_replay_dir" not in updated:
            return
        directory = ctx.options.tito_replay_dir
        if not directory:
            self.index = None
            return
        try:
            self.index = ReplayIndex.load(Path(directory))
        except (RecordError, OSError, ValueError) as exc:
            raise exceptions.OptionsError(f"cannot replay {directory}: {exc}") from exc
        logger.info("tito: replaying %d recorded turns from %s", self.index.turns, directory)

    def request(self, flow: http.HTTPFlow) -> None:
        if self.index is None or flow.response is not None or not flow.live:
            return
        if flow.request.method != "POST" or not is_chat_path(flow.request.path):
            return
        try:
            flow.response = self._answer(flow)
        except Exception:
            logger.exception("tito: replay failed")
            body = TitoError("internal error in tito_addon replay").body()
            flow.response = http.Response.make(500, body, {"content-type": "application/json"})

    def _answer(self, flow: http.HTTPFlow) -> http.Response | None:
        assert self.index is not None
        try:
            request = parse_body(flow.request.content or b"")
        except TitoError as error:
            return http.Response.make(error.status, error.body(), {"content-type": "application/json"})
        found = self.index.answer(request.messages)
        if isinstance(found, ReplayMiss):
            if ctx.options.tito_replay_fallback == "live":
                return None  # the capture addon serves and records it
            body = json.dumps(found.error(), ensure_ascii=False).encode()
            return http.Response.make(404, body, {"content-type": "application/json"})
        completion = replay_completion(found)
        headers = {"x-tito-replay": f"{found.session_id}/{found.turn_id}"}
        flow.metadata["tito"] = {"replayed": True, "session_id": found.session_id, "turn_id": found.turn_id}
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            body = sse_from_completion(completion, include_usage=include_usage)
            return http.Response.make(200, body, {**SSE_HEADERS, **headers})
        body = json.dumps(completion, ensure_ascii=False).encode()
        return http.Response.make(200, body, {"content-type": "application/json", **headers})

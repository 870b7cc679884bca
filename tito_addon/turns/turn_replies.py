"""What an agent gets back besides a turn's message: the reply to a failed turn, and the stop string that ended one."""

from __future__ import annotations

import logging
from typing import Any

from tito_addon.protocols.agent_api import AgentApi
from tito_addon.protocols.http_reply import HttpReply, json_reply
from tito_addon.tito_errors import TitoError, UpstreamPassthrough

logger = logging.getLogger(__name__)


def matched_stop(agent_body: dict[str, Any]) -> str | None:
    """The stop string that ended the turn, if one did: sglang says `matched_stop`, vLLM `stop_reason` (each is a
    token id instead when a stop token ended it)."""
    choices = agent_body.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    for key in ("matched_stop", "stop_reason"):
        if isinstance(choice.get(key), str):
            return choice[key]
    return None


def error_reply(api: AgentApi, exc: BaseException) -> HttpReply:
    """A failed turn in the agent's own API: the upstream's status verbatim, ours with its status and, when retrying
    cannot fix it, `x-should-retry: false`."""
    if isinstance(exc, UpstreamPassthrough):
        body = api.passthrough_body(exc)
        return HttpReply(
            exc.status, {"content-type": exc.content_type if body is exc.body else "application/json"}, body
        )
    if isinstance(exc, TitoError):
        if exc.status >= 500:
            logger.warning("turn failed: %s", exc.message)
        return HttpReply(api.error_status(exc), exc.headers(), api.error_body(exc))
    logger.error("unexpected failure while serving a turn", exc_info=exc)
    return json_reply(500, api.error_body(TitoError("internal error in tito_addon; nothing was recorded")))

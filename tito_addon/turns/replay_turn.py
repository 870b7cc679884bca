"""Offline replay of one request: the recorded turn whose history it repeats, answered in the agent's own API.

A recorded session can be replayed to an agent speaking another API than the one it was recorded in: the request
is translated to the canonical form and matched against the recorded tree like any live request; the recorded
assistant message is answered as it was stored (its tool-call ids kept, so the agent's next request, echoing them,
matches the next recorded turn), streamed when asked. `previous_response_id` names live turns only, so it is not
replayed: send the whole input.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from tito_addon.protocols.agent_api import AgentApi, ReplyContext, TurnOutcome
from tito_addon.protocols.http_reply import HttpReply, json_reply
from tito_addon.protocols.known_messages import DEFAULT_BUDGET_BYTES
from tito_addon.protocols.routing import agent_apis, find_route
from tito_addon.protocols.turn_refs import TurnSigner
from tito_addon.records.replay_index import ReplayIndex, ReplayMiss, replay_completion
from tito_addon.tito_errors import TitoError


@dataclass(frozen=True)
class Miss:
    """No recorded turn matches: the agent gets a 404 in its API naming the closest turn, or a live turn."""

    miss: ReplayMiss
    api: AgentApi

    def reply(self) -> HttpReply:
        details = self.miss.error()
        # The same request misses again: a final refusal, in the status the agent's API gives one.
        missed = TitoError(details["error"]["message"], status=404)
        status, headers = self.api.error_status(missed), missed.headers()
        if self.api.name == "chat":
            return HttpReply(status, headers, json.dumps(details, ensure_ascii=False).encode())
        shaped = json.loads(self.api.error_body(missed))
        shaped["error"].update({k: v for k, v in details["error"].items() if k not in ("message", "type", "code")})
        return HttpReply(status, headers, json.dumps(shaped, ensure_ascii=False).encode())


class ReplayService:
    def __init__(
        self, index: ReplayIndex, signer: TurnSigner | None = None, memo_bytes: int = DEFAULT_BUDGET_BYTES
    ) -> None:
        self.index = index
        self.signer = signer if signer is not None else TurnSigner(secrets.token_bytes(32))
        self.apis: list[AgentApi] = agent_apis(self.signer, memo_bytes)

    def resize_memos(self, memo_bytes: int) -> None:
        for api in self.apis:
            api.resize_memos(memo_bytes)

    def answer(self, path: str, body: bytes) -> HttpReply | Miss | None:
        """The reply (its metadata names the replayed turn); a miss; or None for a path no agent API has."""
        route = find_route(self.apis, path)
        if route is None:
            return None
        api = route.api
        try:
            request = api.parse(body, route.action, route)
            if request.previous_response_id is not None:
                raise TitoError("previous_response_id is not replayed; send the whole input", status=400)
        except TitoError as error:
            return HttpReply(api.error_status(error), error.headers(), api.error_body(error))
        found = self.index.answer(request.chat.messages)
        if isinstance(found, ReplayMiss):
            return Miss(found, api)
        metadata = {"replayed": True, "session_id": found.session_id, "turn_id": found.turn_id}
        headers = {"x-tito-replay": f"{found.session_id}/{found.turn_id}"}
        if route.action == "count_tokens":  # the recorded prompt is exactly the prompt that turn had
            return json_reply(200, api.count_tokens_body(found.prompt_len), metadata)
        completion = replay_completion(found)
        completion_tokens = len(found.completion_ids)
        reply_id = api.reply_id(found.session_id) or completion["id"]
        responder = api.responder(request, ReplyContext(reply_id, found.prompt_len, self.signer, replayed=True))
        outcome = TurnOutcome(
            message=dict(found.assistant_message),
            finish_reason=found.finish_reason,
            prompt_tokens=found.prompt_len,
            completion_tokens=completion_tokens,
            agent_body=completion,
            agent_bytes=None,
            matched_stop=None,
            headers=headers,
            reasoning_tokens=found.reasoning_tokens or 0,
        )
        reply = responder.reply(outcome)
        reply.headers.update(headers)
        reply.metadata = metadata
        return reply

"""sglang (>= 0.5.13): one chat-completion call that generates from our `input_ids`.

sglang's chat endpoint skips its own template when `input_ids` is given but still uses `messages`, `tools`
and `chat_template_kwargs` for its tool and reasoning parsers, so the agent's body goes along unchanged
apart from the forced fields. Completion ids and logprobs come from `meta_info.output_token_logprobs`.
Older servers silently ignore `input_ids`; the echoed `prompt_token_ids` prove the server used ours.
"""

from __future__ import annotations

import logging
from typing import Any

from tito_addon.backend_protocol import (
    BackendResult,
    BackendTurn,
    checked_ids,
    checked_logprobs,
    checked_message,
    trajectory_message,
)
from tito_addon.tito_errors import UpstreamMalformed, UpstreamPassthrough
from tito_addon.upstream_client import UpstreamClient
from tito_addon.wire_models import ChatRequest

logger = logging.getLogger(__name__)


class SglangBackend:
    kind = "sglang"

    def __init__(self, client: UpstreamClient) -> None:
        self.client = client

    def check_request(self, request: ChatRequest) -> None:
        """sglang serves any valid chat request."""

    async def can_stream(self, base_url: str, headers: dict[str, str]) -> bool:
        return False  # live streaming with exact ids needs sglext (0.5.20+); turns are re-framed

    @staticmethod
    def upstream_body(turn: BackendTurn) -> dict[str, Any]:
        body = {k: v for k, v in turn.chat_body.items() if k != "stream_options"}
        body.update(
            input_ids=turn.prompt_ids,
            logprobs=True,
            return_meta_info=True,
            return_prompt_token_ids=True,
            stream=False,
        )
        return body

    async def run_turn(self, turn: BackendTurn) -> BackendResult:
        url = turn.base_url + turn.chat_path
        response = await self.client.post_json(url, self.upstream_body(turn), turn.headers)
        if response.status != 200:
            raise UpstreamPassthrough(response.status, response.body, response.content_type)
        try:
            body = response.json()
        except ValueError as exc:
            raise UpstreamMalformed("backend answered 200 with a body that is not JSON") from exc
        return self.harvest(body, turn)

    def harvest(self, body: Any, turn: BackendTurn) -> BackendResult:
        if not isinstance(body, dict):
            raise UpstreamMalformed("backend answered 200 with JSON that is not an object")
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise UpstreamMalformed("backend answered 200 without choices")
        choice = choices[0]
        echoed = choice.get("prompt_token_ids", body.get("prompt_token_ids"))
        if echoed is None:
            raise UpstreamMalformed(
                "backend did not echo prompt_token_ids, so it cannot be shown to have generated from our ids: "
                "sglang >= 0.5.13 is required (older versions silently ignore input_ids)"
            )
        if echoed != turn.prompt_ids:
            raise UpstreamMalformed(
                "backend generated from different prompt ids than it was sent: it ignored input_ids "
                "(sglang < 0.5.13 re-renders messages) or altered them; nothing was recorded"
            )
        meta = choice.get("meta_info")
        if not isinstance(meta, dict):
            raise UpstreamMalformed("backend answered without meta_info (sglang >= 0.5.13 is required)")
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list) or not entries:
            raise UpstreamMalformed("backend answered without meta_info.output_token_logprobs")
        if not all(isinstance(e, (list, tuple)) and len(e) >= 2 for e in entries):
            raise UpstreamMalformed("meta_info.output_token_logprobs entries are not [logprob, id, text]")
        completion_tokens = meta.get("completion_tokens")
        if type(completion_tokens) is not int or completion_tokens != len(entries):
            raise UpstreamMalformed(
                f"meta_info.completion_tokens ({completion_tokens!r}) does not match the {len(entries)} "
                "output_token_logprobs entries"
            )
        completion_ids = checked_ids([e[1] for e in entries], "completion token ids")
        logprobs = checked_logprobs([e[0] for e in entries], len(completion_ids))
        raw_message = choice.get("message")
        checked_message(raw_message)
        finish_reason = choice.get("finish_reason")
        if finish_reason is not None and not isinstance(finish_reason, str):
            raise UpstreamMalformed("backend returned a finish_reason that is not a string")
        return BackendResult(
            completion_ids=completion_ids,
            completion_logprobs=logprobs,
            message=trajectory_message(raw_message),
            finish_reason=finish_reason,
            agent_body=self.agent_body(body, turn.chat_body),
            usage=body.get("usage") if isinstance(body.get("usage"), dict) else None,
        )

    @staticmethod
    def agent_body(body: dict[str, Any], chat_body: dict[str, Any]) -> dict[str, Any]:
        """The ordinary chat completion: fields we forced on and the agent did not ask for are removed."""
        cleaned = dict(body)
        choices = []
        for choice in body.get("choices", []):
            choice = dict(choice)
            if not chat_body.get("return_meta_info"):
                choice.pop("meta_info", None)
            if not chat_body.get("return_prompt_token_ids"):
                choice.pop("prompt_token_ids", None)
            if not chat_body.get("logprobs"):
                choice["logprobs"] = None
            choices.append(choice)
        cleaned["choices"] = choices
        if not chat_body.get("return_prompt_token_ids"):
            cleaned.pop("prompt_token_ids", None)
        return cleaned

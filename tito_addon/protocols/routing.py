"""Which agent API a request path belongs to, and the APIs a proxy serves."""

from __future__ import annotations

from collections.abc import Sequence

from tito_addon.protocols.agent_api import AgentApi, Route
from tito_addon.protocols.anthropic_messages import MESSAGES_PATH, AnthropicMessagesApi
from tito_addon.protocols.gemini_generate import GEMINI_PATH, GeminiApi
from tito_addon.protocols.known_messages import DEFAULT_BUDGET_BYTES
from tito_addon.protocols.openai_chat import CHAT_PATH, ChatCompletionsApi
from tito_addon.protocols.openai_responses import RESPONSES_PATH, OpenAIResponsesApi
from tito_addon.protocols.turn_refs import TurnSigner

AGENT_PATHS = (CHAT_PATH, MESSAGES_PATH, RESPONSES_PATH, GEMINI_PATH)


def is_agent_path(path: str) -> bool:
    """Whether a POST to this path is an agent turn (or a question about one, like count_tokens)."""
    return any(pattern.match(path) is not None for pattern in AGENT_PATHS)


def agent_apis(
    signer: TurnSigner, memo_bytes: int = DEFAULT_BUDGET_BYTES, warm: Sequence[AgentApi] = ()
) -> list[AgentApi]:
    """The APIs, each remembering up to `memo_bytes` per memo of the requests it read (see `AgentApi.memos`).

    `warm`: the APIs the proxy served until now (a reconfiguration): each that would read requests as a new one
    does is kept, its memos resized, so what it remembers stays. Chat's always would; a signing API's only with
    the same signer object, since its memo holds what that signer opened (sealed reasoning)."""
    kept = {type(api): api for api in warm if not api.signs or getattr(api, "signer", None) is signer}
    for api in kept.values():
        api.resize_memos(memo_bytes)
    return [
        kept.get(ChatCompletionsApi) or ChatCompletionsApi(memo_bytes),
        kept.get(AnthropicMessagesApi) or AnthropicMessagesApi(signer, memo_bytes),
        kept.get(OpenAIResponsesApi) or OpenAIResponsesApi(signer, memo_bytes),
        kept.get(GeminiApi) or GeminiApi(signer, memo_bytes),
    ]


def find_route(apis: list[AgentApi], path: str) -> Route | None:
    for api in apis:
        route = api.route(path)
        if route is not None:
            return route
    return None

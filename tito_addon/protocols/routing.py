"""Which agent API a request path belongs to."""

from __future__ import annotations

from tito_addon.protocols.agent_api import AgentApi, Route
from tito_addon.protocols.anthropic_messages import MESSAGES_PATH, AnthropicMessagesApi
from tito_addon.protocols.openai_chat import CHAT_PATH, ChatCompletionsApi
from tito_addon.protocols.openai_responses import RESPONSES_PATH, OpenAIResponsesApi
from tito_addon.protocols.turn_refs import TurnSigner

AGENT_PATHS = (CHAT_PATH, MESSAGES_PATH, RESPONSES_PATH)


def is_agent_path(path: str) -> bool:
    """Whether a POST to this path is an agent turn (or a question about one, like count_tokens)."""
    return any(pattern.match(path) is not None for pattern in AGENT_PATHS)


def agent_apis(signer: TurnSigner) -> list[AgentApi]:
    return [ChatCompletionsApi(), AnthropicMessagesApi(signer), OpenAIResponsesApi(signer)]


def find_route(apis: list[AgentApi], path: str) -> Route | None:
    for api in apis:
        route = api.route(path)
        if route is not None:
            return route
    return None

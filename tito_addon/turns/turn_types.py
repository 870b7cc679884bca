"""The turn layer's own shapes: a request once validated, and once placed in its session's tree.

Kept apart from the service that makes them, so the modules it calls (the record line, the sessions' records) read
them without importing the service back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from tito_addon.canonical_chat import ChatMessage, ChatRequest
from tito_addon.chat_images import PromptImage
from tito_addon.engine.prompt_ids import PromptIds
from tito_addon.engine.token_engine import PromptPiece
from tito_addon.protocols.agent_api import AgentRequest, Route
from tito_addon.sessions.message_keys import MessageKey
from tito_addon.sessions.session_ids import automatic_session_id
from tito_addon.sessions.session_tree import Attachment, TurnNode
from tito_addon.turns.episode_places import EpisodePlace


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request, before it is placed in a session tree."""

    route: Route
    agent: AgentRequest
    session_id: str | None
    kwargs: dict[str, Any]
    keys: list[MessageKey]
    reasonings: list[str | None]
    namespace: str
    base_url: str = ""

    @property
    def link_scope(self) -> str:
        """Where a new root of this request may find the turn it continues (`turns/episode_places`): its named
        session, or the automatic sessions of its backend."""
        return self.session_id if self.session_id is not None else f"auto {self.base_url}"


@dataclass(frozen=True)
class PreparedTurn:
    """Everything decided before the backend call; nothing here has changed any state. It is the sessions'
    `Placement` of the turn."""

    route: Route
    agent: AgentRequest
    request: ChatRequest  # the canonical request (agent.chat)
    session_id: str | None
    attachment: Attachment
    parent: TurnNode | None
    appended: list[ChatMessage]
    piece: PromptPiece
    prompt: PromptIds
    kwargs: dict[str, Any]
    keys: list[MessageKey]
    namespace: str
    # The digest of all the request's message keys (its GRPO group, when it is a first turn), where the sessions use
    # one (Redis).
    group: bytes = b""
    # Its place in its episode, and where its commit is remembered for later roots to link to.
    place: EpisodePlace = EpisodePlace(None)
    link_scope: str = ""
    # Every image of its prompt with its bytes and place (`prompt_images`): what the backend is sent.
    images: tuple[PromptImage, ...] = ()

    @functools.cached_property
    def new_session_id(self) -> str:
        """The id a new automatic session will get, known before the commit so a reply id can name it. Minted when
        first asked (a first turn's reply or claim): a turn that continues a session never needs one, and minting
        reads the system's random source."""
        return automatic_session_id()

"""Where a turn stands in its agent's episode: which episode, what kind of call, and which turn it continues.

Real agents break their context. They compact it (a summary, then a new context built from the summary), run
sub-agents (other conversations, whose answers come back as a tool result) and side calls (titles, checks). Each of
these is a new root: no stored turn's history is its prefix. The rules below place every turn from the wire alone:

- A continuation (a turn that extends a stored one) inherits its parent's episode and call, except a compaction
  request, whose last user message holds an agent's compaction instruction (`COMPACTION_PROMPTS`): its call is
  `compaction`. A turn that extends a compaction turn returns to the call the compaction interrupted.
- A new root is linked by its content to a recorded turn, within its named session, or among the automatic sessions
  of its backend (a new root of an automatic session is its own session, so a link there crosses sessions):
  1. a user message holds a recorded summary verbatim (what a compaction turn answered, the inside of its
     `<summary>` block where it has one): the context rebuilt after that compaction; it continues the compacted
     segment's call and `follows` the summary turn (how: `summary`);
  2. a user message is a recorded tool call's argument (equal to it; or holding it, for the agents' own spawning
     tools, `SPAWNING_TOOLS`): a sub-agent, `follows` the turn whose call spawned it, with the call's id (how:
     `tool_argument`). Any user message: Codex puts its environment before the task;
  3. otherwise, in an automatic session it starts an episode of its own (`main`); in a named session the first root
     is `main`, and any later one a `side` call, with the reason.
  A new root that is a compaction request (Gemini CLI sends its requests under a system instruction of their own)
  is placed by these rules, its call `compaction`.
- A compaction item the proxy minted (server-side compaction) names its summary turn exactly (how: `compaction_item`).

Named sessions are episodes; an automatic session holds one episode per root it starts (a GRPO group's samples are
sibling roots), named `SESSION/TURN` after that root.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from tito_addon.canonical_chat import ChatMessage, parse_arguments
from tito_addon.protocols.compaction_items import summary_of
from tito_addon.sessions.session_space import LinkStore
from tito_addon.sessions.session_tree import TurnNode


@dataclass(frozen=True)
class CompactionPrompt:
    agent: str
    marker: str  # what the agent's compaction request holds in its last user message


# Measured with the pinned CLIs (README, "Episodes"): each one's summarisation instruction.
COMPACTION_PROMPTS = (
    CompactionPrompt("Claude Code", "Your task is to create a detailed summary of the conversation so far"),
    CompactionPrompt("Codex", "You are performing a CONTEXT CHECKPOINT COMPACTION"),
    # Gemini CLI 0.61 asks for a <state_snapshot> under its compression system instruction, then asks again with the
    # answer echoed, to check it, without the first instruction: each a new root, each a compaction.
    CompactionPrompt("Gemini CLI", "Then, generate the updated <state_snapshot>."),
    CompactionPrompt("Gemini CLI", "Critically evaluate the <state_snapshot> you just generated."),
)
# Tools whose argument is a sub-agent's first message, as the agent words it (Claude Code's task tool, Codex's agent
# spawning): a new root that holds such an argument is that sub-agent even when the agent wraps it.
SPAWNING_TOOLS = frozenset({"Task", "Agent", "spawn_agent"})
MIN_SUMMARY_CHARS = 32  # shorter texts would link by accident
MIN_ARGUMENT_CHARS = 24
MAX_TARGET_CHARS = 256 * 1024  # a longer text is not remembered (bounded memory; no agent sends such a summary)


@dataclass(frozen=True)
class Follows:
    session: str
    turn_id: int
    how: str  # summary, tool_argument, compaction_item
    tool_call_id: str | None = None

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"session": self.session, "turn_id": self.turn_id}
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        out["how"] = self.how
        return out


@dataclass(frozen=True)
class EpisodePlace:
    """A prepared turn's place. `episode` None: the turn starts an episode, named once its session and turn id are
    settled (`episode_of`)."""

    episode: str | None
    call: str = "main"
    follows: Follows | None = None
    reason: str | None = None

    def episode_of(self, session_id: str, turn_id: int, automatic: bool) -> str:
        if self.episode is not None:
            return self.episode
        return f"{session_id}/{turn_id}" if automatic else session_id


def compaction_prompt(messages: Sequence[ChatMessage]) -> CompactionPrompt | None:
    """The agent whose compaction instruction the request's last user message holds."""
    for message in reversed(messages):
        if message.role == "user":
            text = message.text() or ""
            return next((prompt for prompt in COMPACTION_PROMPTS if prompt.marker in text), None)
        if message.role == "assistant":
            return None
    return None


def interrupted_call(node: TurnNode | None) -> str:
    """The call a turn continues: its own, or for a compaction turn the call that compaction interrupted."""
    while node is not None and node.turn.call == "compaction":
        node = node.parent
    return node.turn.call if node is not None else "main"


def continuation_place(parent: TurnNode, appended: Sequence[ChatMessage]) -> EpisodePlace:
    compaction = compaction_prompt(appended)
    if compaction is not None:
        return EpisodePlace(parent.turn.episode_id, "compaction", reason=f"{compaction.agent}'s compaction instruction")
    return EpisodePlace(parent.turn.episode_id, interrupted_call(parent))


class EpisodeLinks:
    """The linking rules over what the sessions keep for them (`LinkStore`: this process's, or a shared Redis):
    per scope (a named session, or the automatic sessions of a backend) the summaries of compaction turns and the
    string arguments of tool calls, newest first."""

    def __init__(self, store: LinkStore) -> None:
        self.store = store

    async def note(self, scope: str, line: dict[str, Any], resumes: str) -> None:
        """Remember what a committed turn (its record line's fields) offers later roots; `resumes`: the call it
        continues (for a compaction turn, the call it interrupted)."""
        target = {
            "session": line["session_id"],
            "turn": line["turn_id"],
            "episode": line["episode"],
            "resumes": resumes,
        }
        message = line.get("assistant_message") or {}
        content = message.get("content")
        calls = message.get("tool_calls") or []
        entries: list[tuple[str, dict[str, Any]]] = []
        if isinstance(content, str) and not calls and (line.get("call") == "compaction" or "<summary>" in content):
            summary = summary_of(content)
            if MIN_SUMMARY_CHARS <= len(summary) <= MAX_TARGET_CHARS:
                entries.append(("summary", {**target, "text": summary}))
        for call in calls:
            function = call.get("function") or {}
            arguments = parse_arguments(function.get("arguments") or "{}")
            values = arguments.values() if isinstance(arguments, dict) else [arguments]
            name = str(function.get("name") or "")
            # Codex's namespaced tools reach the model flattened (`multi_agent_v1__spawn_agent`).
            spawning = name in SPAWNING_TOOLS or name.rpartition("__")[2] in SPAWNING_TOOLS
            for value in values:
                text = value.strip() if isinstance(value, str) else ""
                if MIN_ARGUMENT_CHARS <= len(text) <= MAX_TARGET_CHARS:
                    entry = {**target, "text": text, "spawning": spawning, "call_id": call.get("id")}
                    entries.append(("argument", entry))
        if entries:  # one write a turn, and none for most turns
            await self.store.add(scope, entries)

    async def place_root(
        self, scope: str, messages: Sequence[ChatMessage], named: bool, first_root: bool
    ) -> EpisodePlace:
        """The place of a new root (rules 1 to 3 of the module's docstring); a compaction request's call is
        `compaction` wherever they place it."""
        place = await self._linked_root(scope, messages, named, first_root)
        compaction = compaction_prompt(messages)
        if compaction is None:
            return place
        return replace(place, call="compaction", reason=f"{compaction.agent}'s compaction instruction")

    async def _linked_root(
        self, scope: str, messages: Sequence[ChatMessage], named: bool, first_root: bool
    ) -> EpisodePlace:
        user_texts = [message.text() or "" for message in messages if message.role == "user"]
        for entry in await self.store.entries(scope, "summary"):
            if any(entry["text"] in text for text in user_texts):
                follows = Follows(entry["session"], entry["turn"], "summary")
                return EpisodePlace(entry["episode"], entry["resumes"], follows)
        stripped = [text.strip() for text in user_texts]
        found = [
            entry
            for entry in await self.store.entries(scope, "argument")
            if entry["text"] in stripped or (entry["spawning"] and any(entry["text"] in t for t in user_texts))
        ]
        if found:
            # Newest first; among the calls of one turn with the same task, the oldest no sub-agent took yet (taken
            # now, not at the commit: sub-agents spawned together start together, on any proxy).
            same = [e for e in found if (e["session"], e["turn"]) == (found[0]["session"], found[0]["turn"])]
            target = same[-1]
            for entry in reversed(same):
                if await self.store.claim(json.dumps([entry["session"], entry["turn"], entry["call_id"]])):
                    target = entry
                    break
            follows = Follows(target["session"], target["turn"], "tool_argument", target["call_id"])
            return EpisodePlace(target["episode"], "subagent", follows)
        if not named or first_root:
            return EpisodePlace(None)
        return EpisodePlace(None, "side", reason="a new root of the session that holds no recorded summary and "
                                                 "starts from no recorded tool call")  # fmt: skip


def record_fields(place: EpisodePlace, episode: str) -> dict[str, Any]:
    return {
        "episode": episode,
        "call": place.call,
        "follows": place.follows.fields() if place.follows is not None else None,
        "call_reason": place.reason,
    }

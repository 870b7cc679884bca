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
- A compaction item the proxy minted (server-side compaction) names its summary turn exactly (how: `compaction_item`).

Named sessions are episodes; an automatic session holds one episode per root it starts (a GRPO group's samples are
sibling roots), named `SESSION/TURN` after that root.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tito_addon.canonical_chat import ChatMessage, parse_arguments
from tito_addon.protocols.compaction_items import summary_of
from tito_addon.sessions.session_tree import TurnNode


@dataclass(frozen=True)
class CompactionPrompt:
    agent: str
    marker: str  # what the agent's compaction request holds in its last user message


# Measured with the pinned CLIs (README, "Episodes"): each one's summarisation instruction.
COMPACTION_PROMPTS = (
    CompactionPrompt("Claude Code", "Your task is to create a detailed summary of the conversation so far"),
    CompactionPrompt("Codex", "You are performing a CONTEXT CHECKPOINT COMPACTION"),
)
# Tools whose argument is a sub-agent's first message, as the agent words it (Claude Code's task tool, Codex's agent
# spawning): a new root that holds such an argument is that sub-agent even when the agent wraps it.
SPAWNING_TOOLS = frozenset({"Task", "Agent", "spawn_agent"})
MIN_SUMMARY_CHARS = 32  # shorter texts would link by accident
MIN_ARGUMENT_CHARS = 24
MAX_TARGET_CHARS = 256 * 1024  # a longer text is not remembered (bounded memory; no agent sends such a summary)
TARGETS_PER_SCOPE = 256
SCOPES = 4096


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


@dataclass(frozen=True)
class LinkTarget:
    """A recorded turn a later root may continue: where it is, its episode and its call."""

    session_id: str
    turn_id: int
    episode: str
    resumes: str  # the call a context rebuilt from this turn's summary continues
    tool_call_id: str | None = None


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
    while node is not None and node.call == "compaction":
        node = node.parent
    return node.call if node is not None else "main"


def continuation_place(parent: TurnNode, appended: Sequence[ChatMessage]) -> EpisodePlace:
    compaction = compaction_prompt(appended)
    if compaction is not None:
        return EpisodePlace(parent.episode, "compaction", reason=f"{compaction.agent}'s compaction instruction")
    return EpisodePlace(parent.episode, interrupted_call(parent))


class EpisodeLinks:
    """What new roots may link to, remembered per scope (a named session, or the automatic sessions of a backend):
    the summaries of compaction turns and the string arguments of tool calls, newest first, bounded."""

    def __init__(self, per_scope: int = TARGETS_PER_SCOPE, scopes: int = SCOPES) -> None:
        self.per_scope = per_scope
        self.scopes = scopes
        self._summaries: OrderedDict[str, deque[tuple[str, LinkTarget]]] = OrderedDict()
        self._arguments: OrderedDict[str, deque[tuple[str, bool, LinkTarget]]] = OrderedDict()
        # Tool calls a sub-agent was placed after: a second sub-agent with the same task is the next such call's.
        self._spawned: OrderedDict[tuple[str, int, str | None], None] = OrderedDict()

    def _entries(self, table: OrderedDict[str, deque], scope: str) -> deque:
        entries = table.get(scope)
        if entries is None:
            entries = table[scope] = deque(maxlen=self.per_scope)
            while len(table) > self.scopes:
                table.popitem(last=False)
        table.move_to_end(scope)
        return entries

    def note(self, scope: str, line: dict[str, Any], resumes: str) -> None:
        """Remember what a committed turn (its record line's fields) offers later roots; `resumes`: the call it
        continues (for a compaction turn, the call it interrupted)."""
        target = LinkTarget(line["session_id"], line["turn_id"], line["episode"], resumes)
        message = line.get("assistant_message") or {}
        content = message.get("content")
        calls = message.get("tool_calls") or []
        if isinstance(content, str) and not calls and (line.get("call") == "compaction" or "<summary>" in content):
            summary = summary_of(content)
            if MIN_SUMMARY_CHARS <= len(summary) <= MAX_TARGET_CHARS:
                self._entries(self._summaries, scope).appendleft((summary, target))
        for call in calls:
            function = call.get("function") or {}
            arguments = parse_arguments(function.get("arguments") or "{}")
            values = arguments.values() if isinstance(arguments, dict) else [arguments]
            name = str(function.get("name") or "")
            # Codex's namespaced tools reach the model flattened (`multi_agent_v1__spawn_agent`).
            spawning = name in SPAWNING_TOOLS or name.rpartition("__")[2] in SPAWNING_TOOLS
            linked = LinkTarget(target.session_id, target.turn_id, target.episode, target.resumes, call.get("id"))
            for value in values:
                text = value.strip() if isinstance(value, str) else ""
                if MIN_ARGUMENT_CHARS <= len(text) <= MAX_TARGET_CHARS:
                    self._entries(self._arguments, scope).appendleft((text, spawning, linked))

    def place_root(self, scope: str, messages: Sequence[ChatMessage], named: bool, first_root: bool) -> EpisodePlace:
        """The place of a new root (rules 1 to 3 of the module's docstring)."""
        user_texts = [message.text() or "" for message in messages if message.role == "user"]
        for summary, target in self._summaries.get(scope, ()):
            if any(summary in text for text in user_texts):
                follows = Follows(target.session_id, target.turn_id, "summary")
                return EpisodePlace(target.episode, target.resumes, follows)
        stripped = [text.strip() for text in user_texts]
        found: list[LinkTarget] = []
        for argument, spawning, target in self._arguments.get(scope, ()):
            if argument in stripped or (spawning and any(argument in text for text in user_texts)):
                found.append(target)
        if found:
            # Newest first; among calls with the same task, the oldest no sub-agent follows yet.
            same = [t for t in found if (t.session_id, t.turn_id) == (found[0].session_id, found[0].turn_id)]
            free = [t for t in same if (t.session_id, t.turn_id, t.tool_call_id) not in self._spawned]
            target = (free or same)[-1]
            # Taken now, not at the commit: sub-agents spawned together start together.
            self._spawned[(target.session_id, target.turn_id, target.tool_call_id)] = None
            while len(self._spawned) > self.scopes * self.per_scope:
                self._spawned.popitem(last=False)
            follows = Follows(target.session_id, target.turn_id, "tool_argument", target.tool_call_id)
            return EpisodePlace(target.episode, "subagent", follows)
        if not named or first_root:
            return EpisodePlace(None)
        return EpisodePlace(None, "side", reason="a new root of the session that holds no recorded summary and "
                                                 "starts from no recorded tool call")  # fmt: skip

    def forget(self, scope: str) -> None:
        self._summaries.pop(scope, None)
        self._arguments.pop(scope, None)


def record_fields(place: EpisodePlace, episode: str) -> dict[str, Any]:
    return {
        "episode": episode,
        "call": place.call,
        "follows": place.follows.fields() if place.follows is not None else None,
        "call_reason": place.reason,
    }

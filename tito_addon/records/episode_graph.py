"""An episode's shape, as the record browser draws it: its segments and the links between them, and each session's tree.

Segments are the export's (one row each): numbered in the order their first turns were recorded, each with its call
kind. Two kinds of link join them: a segment that starts from a turn of another segment (a compaction request that
extends the main history, a branch off a run of another call) `extends` that turn; a segment whose first turn names
the turn it continues (`follows`: a context rebuilt from a summary, a sub-agent spawned by a tool call) follows it.
A session's tree shows every turn of the episode in it; turns that share a parent, and roots that share their first
prompt, are siblings (branches, GRPO samples from one point).
"""

from __future__ import annotations

from typing import Any

from tito_addon.records.record_catalog import Catalog, SessionDigest
from tito_addon.records.rollout_groups import EpisodeView


def episode_graph(catalog: Catalog, view: EpisodeView) -> dict[str, Any]:
    by_session = {id(d.session): d for d in catalog.sessions}
    where: dict[tuple[str, int], int] = {}  # (session, turn) -> segment index
    for segment in view.segments:
        for turn in segment.path:
            where.setdefault((turn.session_id, turn.turn_id), segment.index)
    segments = []
    links = []
    for segment in view.segments:
        digest = by_session[id(segment.session)]
        first, leaf = segment.path[0], segment.leaf
        segments.append({
            "index": segment.index,
            "call": segment.call,
            "session": first.session_id,
            "turns": [turn.turn_id for turn in segment.path],
            "first_at": first.ts,
            "length": leaf.prompt_len + digest.lengths[leaf.turn_id][1],
            "sampled_tokens": sum(digest.lengths[turn.turn_id][1] for turn in segment.path),
            "reward": segment.notes.reward,
            "labels": segment.notes.labels,
            "leaf": leaf.turn_id,
        })  # fmt: skip
        if first.parent_turn_id is not None:
            source = where.get((first.session_id, first.parent_turn_id))
            if source is not None:
                links.append({"from": source, "to": segment.index, "kind": "extends", "turn": first.parent_turn_id})
        if first.follows is not None:
            source = where.get((first.follows.session, first.follows.turn_id))
            links.append({
                "from": source,
                "to": segment.index,
                "kind": "follows",
                "how": first.follows.how,
                "session": first.follows.session,
                "turn": first.follows.turn_id,
                "tool_call_id": first.follows.tool_call_id,
            })  # fmt: skip
    trees = [session_tree(by_session[key], where) for key in dict.fromkeys(id(s.session) for s in view.segments)]
    return {
        "episode": view.episode,
        "group": view.group,
        "reward": view.notes.reward,
        "labels": view.notes.labels,
        "metadata": view.notes.metadata,
        "segments": segments,
        "links": links,
        "trees": trees,
    }


def session_tree(digest: SessionDigest, where: dict[tuple[str, int], int]) -> dict[str, Any]:
    """The episode's turns in one session, parents before children, each with what the tree view draws."""
    session_id = digest.summary["session_id"]
    turns = [t for t in digest.session.turns if (t.session_id, t.turn_id) in where]
    children: dict[int | None, list[int]] = {}
    for turn in turns:
        children.setdefault(turn.parent_turn_id, []).append(turn.turn_id)
    nodes = []
    for turn in turns:
        added, sampled = digest.lengths[turn.turn_id]
        if turn.parent_turn_id is not None:
            siblings = [t for t in children[turn.parent_turn_id] if t != turn.turn_id]
        else:  # roots are siblings when they are samples of one first prompt (its digest: the automatic group)
            group = digest.auto_groups.get(turn.turn_id)
            siblings = [t for t in children[None] if t != turn.turn_id and digest.auto_groups.get(t) == group]
        nodes.append({
            "turn_id": turn.turn_id,
            "parent": turn.parent_turn_id,
            "call": turn.call,
            "segment": where[(session_id, turn.turn_id)],
            "prompt_len": turn.prompt_len,
            "added": added,
            "sampled": sampled,
            "finish_reason": turn.finish_reason,
            "weight_version": turn.weight_version,
            "ts": turn.ts,
            "siblings": siblings,
            "leaf": turn.turn_id not in children,
        })  # fmt: skip
    return {"session": session_id, "turns": nodes}


def group_view(catalog: Catalog, group: str) -> dict[str, Any]:
    """A GRPO group as a trainer sees it: its episodes side by side, with their rewards, lengths and segments, and the
    group's mean reward and its spread over the scored ones."""
    rows = [row for row in catalog.episodes if row["group"] == group]
    rewards = [row["reward"] for row in rows if row["reward"] is not None]
    mean = sum(rewards) / len(rewards) if rewards else None
    spread = (
        (sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) ** 0.5
        if mean is not None and len(rewards) > 1
        else None
    )
    episodes = []
    for row in rows:
        view = catalog.views[row["episode"]]
        last = view.segments[-1].leaf
        episodes.append({**row, "advantage": None if row["reward"] is None or mean is None else row["reward"] - mean,
                         "last_turn": {"session": last.session_id, "turn_id": last.turn_id},
                         "answer": message_text(last.assistant_message)})  # fmt: skip
    return {"group": group, "episodes": episodes, "mean_reward": mean, "reward_std": spread}


def message_text(message: dict[str, Any], most: int = 400) -> str:
    """What an assistant message said, shortened: its text, else its tool calls by name."""
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    text = content if isinstance(content, str) else ""
    if not text.strip():
        names = [str((call.get("function") or {}).get("name")) for call in message.get("tool_calls") or []]
        text = ("→ " + ", ".join(names)) if names else ""
    return text if len(text) <= most else text[: most - 1] + "…"

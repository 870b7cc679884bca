"""Compactions the proxy serves itself, with the model being trained: what the model is asked, and the item that
carries the summary back to the agent.

An agent that leaves compaction to the server (OpenAI Responses' `compaction_trigger` input item and
`POST /v1/responses/compact`, as Codex does with a provider named `azure` or `OpenAI`) gets it from the backend's own
model: the request's conversation plus `SERVED_COMPACTION_PROMPT` as the last user message is a turn like any other,
token exact and recorded (its call `compaction`). Its answer goes back as a `compaction` item whose
`encrypted_content` seals the summary (the inside of its `<summary>` block, else the whole answer) with the id of the
reply that made it, under the proxy's key; the agent echoes the item in its next requests, where it reads as a user
message holding the summary, and the new context it starts follows the summary turn it names. A compaction item this
proxy did not mint, or one whose seal fails, is refused: there is no summary to put in its place.
"""

from __future__ import annotations

import re

COMPACTION_PURPOSE = "compaction-summary"
COMPACT_ENDPOINT = "the compact endpoint"  # what asked for a compaction, besides an item
COMPACT_EDIT = "compact_20260112"  # Anthropic's context_management edit
# What the model is asked when the agent asks the server to compact (no agent's own words: each agent's local
# compaction instruction is recognised by `turns/episode_places`).
SERVED_COMPACTION_PROMPT = (
    "Your context is about to be compacted. Write a summary of the conversation so far that lets you continue the "
    "task from the summary alone: the user's requests, what was done and found (commands, files, results), and what "
    "remains to do. Answer with text only, the summary inside <summary></summary> tags."
)
SUMMARY_BLOCK = re.compile(r"<summary>(.*?)</summary>", re.DOTALL)


def summary_of(text: str) -> str:
    """What a summary turn's answer carries into the next context: the inside of its last `<summary>` block, else
    the whole answer; stripped."""
    blocks = SUMMARY_BLOCK.findall(text)
    return (blocks[-1] if blocks else text).strip()

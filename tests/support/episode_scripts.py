"""Episodes as agents send them, for tests that need one recorded: Claude Code's (main turns, a compaction, the
context rebuilt from its summary, a sub-agent and a side call) through the real anthropic SDK, and the texts Claude
Code and Codex send for a compaction (measured from the pinned CLIs; README, "Episodes")."""

from __future__ import annotations

import anthropic

from support.anthropic_agent import echo

SUBAGENT_PROMPT = "List the files of this folder and report their names, one per line."
# Claude Code's compaction instruction (its start and the sentence the proxy recognises), appended to the last user
# message of the request it compacts; the wrapper its next context puts the summary in.
CLAUDE_COMPACT = (
    "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.\n\n- Your entire response must be plain text: an "
    "<analysis> block followed by a <summary> block.\n\nYour task is to create a detailed summary of the conversation "
    "so far, paying close attention to the user's explicit requests and your previous actions."
)
CLAUDE_WRAPPER = (
    "This session is being continued from a previous conversation that ran out of context. The summary below covers "
    "the earlier portion of the conversation.\n\n<system-reminder>\n<tools-used-before-summary>Bash"
    "</tools-used-before-summary>\n</system-reminder>\nSummary:\n{summary}\n\nIf you need specific details from before "
    "compaction (like exact code snippets), read the full transcript."
)
REMINDER = "<system-reminder>\nAttribution: none.\n</system-reminder>\n"
CODEX_COMPACT = (
    "You are performing a CONTEXT CHECKPOINT COMPACTION. Create a handoff summary for another LLM that will resume "
    "the task."
)
CODEX_WRAPPER = (
    "Another language model started to solve this problem and produced a summary of its thinking process. Here is "
    "the summary produced by the other language model, use the information in this summary to assist with your own "
    "analysis:\n{summary}"
)
BASH = {
    "name": "Bash",
    "description": "Run a shell command.",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}
AGENT = {
    "name": "Agent",
    "description": "Launch a sub-agent.",
    "input_schema": {
        "type": "object",
        "properties": {"description": {"type": "string"}, "prompt": {"type": "string"}},
        "required": ["description", "prompt"],
    },
}


def results(message, text: str = "a.txt\nb.txt") -> dict:
    blocks = [
        {"type": "tool_result", "tool_use_id": b.id, "content": text} for b in message.content if b.type == "tool_use"
    ]
    return {"role": "user", "content": blocks}


def with_text(message: dict, text: str) -> dict:
    """A user message with one more text block, as Claude Code appends its compaction instruction."""
    return {"role": "user", "content": [*message["content"], {"type": "text", "text": text}]}


def claude_code_episode(*apis: anthropic.Anthropic) -> dict[str, str]:
    """Main turns, a compaction (a sibling of the last main turn, as Claude Code sends it), the context rebuilt from
    the summary, a sub-agent spawned from it and answered, and a side call; request N through `apis[N % len]`.
    Returns the summary text and the id of the call that spawned the sub-agent."""
    sent = [0]

    def create(messages, tools=(BASH,), **kw):
        api = apis[sent[0] % len(apis)]
        sent[0] += 1
        return api.messages.create(model="qwen3", max_tokens=400, tools=list(tools), messages=messages, **kw)

    system = "You are Claude Code."
    messages: list[dict] = [{"role": "user", "content": "Check this folder."}]
    first = create(messages, system=system)  # turn 0: a tool call
    assert first.stop_reason == "tool_use"
    messages += [echo(first), results(first)]
    answer = create(messages, system=system)  # 1: the answer
    messages += [echo(answer), {"role": "user", "content": "Check it again."}]
    again = create(messages, system=system)  # 2: a tool call
    messages += [echo(again), results(again)]
    last = create(messages, system=system)  # 3: the answer
    compact = [*messages[:-1], with_text(messages[-1], CLAUDE_COMPACT)]
    summary_turn = create(compact, system=system)  # 4: the summary, a sibling of 3
    text = "".join(b.text for b in summary_turn.content if b.type == "text")
    summary = text.split("<summary>")[1].split("</summary>")[0].strip()
    rebuilt = [
        {"role": "user", "content": CLAUDE_WRAPPER.format(summary=summary)},
        echo(last),
        {"role": "user", "content": "Now have an agent list the files."},
    ]
    spawn = create(rebuilt, tools=(AGENT, BASH), system=system)  # 5: a new root that follows 4; calls Agent
    (use,) = [b for b in spawn.content if b.type == "tool_use"]
    assert use.name == "Agent" and use.input["prompt"] == SUBAGENT_PROMPT
    sub = [{"role": "user", "content": [{"type": "text", "text": REMINDER}, {"type": "text", "text": SUBAGENT_PROMPT}]}]
    sub_call = create(sub, system="You are a file search specialist.")  # 6: the sub-agent's root
    sub += [echo(sub_call), results(sub_call)]
    sub_answer = create(sub, system="You are a file search specialist.")  # 7
    report = "".join(b.text for b in sub_answer.content if b.type == "text")
    rebuilt += [echo(spawn), results(spawn, "  " + report.replace("\n", "\n  "))]
    create(rebuilt, tools=(AGENT, BASH), system=system)  # 8: the parent goes on
    side = [{"role": "user", "content": "Write a five word title for: Check this folder."}]
    apis[sent[0] % len(apis)].messages.create(model="claude-haiku", max_tokens=30, messages=side)  # 9: a side call
    return {"summary": summary, "spawn_call": use.id}

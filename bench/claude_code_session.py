"""The proxy's added latency per turn on a streamed Anthropic Messages session shaped like Claude Code's (issue 42):
a ~12k-token system prompt and tool list sent whole every turn, the history growing by the model's tool call and a
~500-token tool result each turn, `cache_control` markers where Claude Code puts them (the system prompt, the last
tool, and the newest user block, so the previous request's last message changes), compact JSON as Node writes it,
`stream: true`. The model's turn is a tool call (qwen3's ids for it), streamed as sglang 0.5.20+ streams; the agent
reads the addon's event stream to the end and sends back the `tool_use` block it read, as Claude Code does.

Each turn is sent through the addon, then the very body the addon sent the backend (the prompt as ids, streamed) is
sent through plain mitmdump and read to its end: `added_ms` is the median over the five turns around a checkpoint of
the addon's time less plain mitmdump's, the proxy's own cost. Interleaved turn by turn, so a slow moment of the
machine lands on both.

    .venv/bin/python bench/claude_code_session.py [--turns 200] [--repo PATH]   # prints JSON

`--repo`: the checkout whose addon is measured (a `git worktree` of another revision), for a before and after in one
session.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from pathlib import Path

from local_servers import Backend, PlainMitmdump
from measurements import REPO, TOKENIZER, added_at
from p1_session import CHECKPOINTS, TOOL_RESULT
from zero_latency_backend import Reply

from tito_addon.replicas.proxy_process import Mitmdump

CALL = {"name": "Bash", "arguments": '{"command": "ls -la src"}'}
MARKER = {"type": "ephemeral"}


def system_prompt() -> list[dict]:
    rule = "{0}. When working on task area {0}, read the relevant files first, keep changes small, run the tests for "
    rule += "area {0}, and report what changed and why in one short paragraph."
    rules = [rule.format(i) for i in range(1, 90)]
    text = "You are an interactive CLI tool that helps users with software engineering tasks.\n" + "\n".join(rules)
    return [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {"type": "text", "text": text, "cache_control": MARKER}]  # fmt: skip


def tools() -> list[dict]:
    names = ["Task", "Bash", "Glob", "Grep", "LS", "ExitPlanMode", "Read", "Edit", "MultiEdit", "Write",
             "NotebookEdit", "WebFetch", "TodoWrite", "WebSearch", "BashOutput", "KillShell"]  # fmt: skip
    out = []
    for index, name in enumerate(names):
        description = " ".join(f"{name} usage note {k}: prefer the dedicated tool, quote paths with spaces, and "
                               f"never run it on files outside the working directory." for k in range(12))  # fmt: skip
        schema = {"type": "object", "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#",
                  "required": ["command"], "properties": {
                      "command": {"type": "string", "description": f"The {name} input."},
                      "timeout": {"type": "number", "description": "Optional timeout in milliseconds (max 600000)"},
                      "description": {"type": "string", "description": "Clear, concise description in 5-10 words."},
                  }}  # fmt: skip
        tool = {"name": name, "description": description, "input_schema": schema}
        if index == len(names) - 1:
            tool["cache_control"] = MARKER
        out.append(tool)
    return out


def body_of(messages: list[dict]) -> bytes:
    """The request as Claude Code writes it (Node's JSON.stringify: compact, UTF-8 as is), the marker on the newest
    user block only."""
    marked = [dict(m) for m in messages]
    last = marked[-1]
    last["content"] = [*last["content"][:-1], {**last["content"][-1], "cache_control": MARKER}]
    body = {"model": "claude-sonnet-4-5", "messages": marked, "temperature": 1, "system": system_prompt(),
            "tools": tools(), "metadata": {"user_id": "user_bench_account__session_0"}, "max_tokens": 32000,
            "stream": True}  # fmt: skip
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def post_stream(url: str, data: bytes, path: str) -> tuple[float, bytes]:
    """Seconds one streamed request takes, its event stream read to the end, and the stream."""
    request = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json",
                                                                      "anthropic-version": "2023-06-01"})  # fmt: skip
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        stream = response.read()
    return time.perf_counter() - started, stream


def assistant_of(stream: bytes) -> dict:
    """The assistant message an Anthropic client builds from the event stream it read."""
    blocks: list[dict] = []
    partial: dict[int, str] = {}
    for line in stream.splitlines():
        if not line.startswith(b"data: "):
            continue
        event = json.loads(line[6:])
        kind = event.get("type")
        if kind == "content_block_start":
            blocks.append(dict(event["content_block"]))
            partial[event["index"]] = ""
        elif kind == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "text_delta":
                blocks[event["index"]]["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                partial[event["index"]] += delta["partial_json"]
        elif kind == "content_block_stop" and blocks[event["index"]]["type"] == "tool_use":
            blocks[event["index"]]["input"] = json.loads(partial[event["index"]] or "{}")
    assert any(b["type"] == "tool_use" for b in blocks), stream[:500]
    return {"role": "assistant", "content": blocks}


def claude_code_session(turns: int, repo: Path = REPO) -> dict:
    from tito_addon.engine.tokenizer_loading import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER, trust_remote_code=False)
    text = f'<tool_call>\n{{"name": "{CALL["name"]}", "arguments": {CALL["arguments"]}}}\n</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False) + tokenizer.convert_tokens_to_ids(["<|im_end|>"])
    backend = Backend(reply=Reply(ids=ids, content=None, tool_call={"id": "call_", **CALL}))
    record_dir = Path(tempfile.mkdtemp(prefix="tito-bench-claude-code-"))
    addon = Mitmdump(backend.url, tokenizer=TOKENIZER, record_dir=record_dir, cwd=record_dir, repo=repo,
                     extra_args=["--set", "flow_detail=0"]).start()  # fmt: skip
    plain = PlainMitmdump(backend.url)
    messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "List the source folder."}]}]
    times: dict[str, list[float]] = {"addon": [], "plain": []}
    request_bytes: dict[int, int] = {}
    try:
        for turn in range(1, turns + 1):
            data = body_of(messages)
            request_bytes[turn] = len(data)
            seconds, stream = post_stream(addon.url, data, "/v1/messages")
            times["addon"].append(seconds)
            times["plain"].append(post_stream(plain.url, backend.last_ids_body(), "/v1/chat/completions")[0])
            answer = assistant_of(stream)
            call = next(b for b in answer["content"] if b["type"] == "tool_use")
            result = {"type": "tool_result", "tool_use_id": call["id"], "content": f"{turn}: {TOOL_RESULT}"}
            messages += [answer, {"role": "user", "content": [result]}]
    finally:
        plain.stop()
        addon.stop()
    return {turn: {"request_kib": request_bytes[turn] / 1024, **added_at(times, turn)}
            for turn in CHECKPOINTS if turn <= turns}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--repo", type=Path, default=REPO)
    args = parser.parse_args()
    print(json.dumps(claude_code_session(args.turns, args.repo), indent=1))


if __name__ == "__main__":
    main()

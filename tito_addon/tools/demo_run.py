"""`python -m tito_addon demo`: a capture end to end, on this machine, with no GPU.

Starts the built-in reference backend (the sglang protocol over a real tokenizer), a real mitmdump with
the addon in reverse mode in front of it, and an unmodified openai-SDK agent running a tool loop through
the proxy; then prints the recorded trajectory and checks it against what the backend saw.

It records into `build/demo-recordings/` (ignored by git), never `recordings/`: that is where a user's own
captures go, and an `export recordings/` would otherwise carry the demo's session into a training set.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from tito_addon.records.record_reader import read_session
from tito_addon.replicas.proxy_process import REPO, Mitmdump
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


DEMO_RECORDINGS = REPO / "build" / "demo-recordings"


def default_tokenizer() -> str:
    shared = REPO.parent / "shared" / "tokenizers" / "qwen3"
    return os.environ.get("TITO_DEMO_TOKENIZER") or (str(shared) if shared.is_dir() else "Qwen/Qwen3-8B")


def run_agent(base_url: str, session_id: str, turns: int) -> None:
    import openai

    client = openai.OpenAI(
        base_url=base_url + "/v1", api_key="demo-key", default_headers={"x-session-id": session_id}, max_retries=0
    )
    messages: list[dict] = [
        {"role": "system", "content": "You are a helpful travel assistant."},
        {"role": "user", "content": "What's the weather in Paris?"},
    ]
    for turn in range(turns):
        reply = client.chat.completions.create(model="reference-model", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        echoed: dict = {"role": "assistant", "content": message.content}
        if message.tool_calls:
            echoed["tool_calls"] = [c.model_dump(include={"id", "type", "function"}) for c in message.tool_calls]
        messages.append(echoed)
        calls = ", ".join(f"{c.function.name}({c.function.arguments})" for c in message.tool_calls or [])
        print(
            f"  agent turn {turn}: {reply.choices[0].finish_reason:10} {calls or (message.content or '').strip()[:70]}"
        )
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21, "sky": "clear"}'})
        if not message.tool_calls:
            messages.append({"role": "user", "content": f"Thanks! And in Oslo (question {turn + 1})?"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tito_addon demo")
    parser.add_argument("--tokenizer", default=default_tokenizer())
    parser.add_argument("--record-dir", type=Path, default=DEMO_RECORDINGS, help=f"default: {DEMO_RECORDINGS}")
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args(argv)
    session_id = time.strftime("demo-%Y%m%d-%H%M%S")
    print(f"reference backend: sglang protocol over the tokenizer {args.tokenizer}")
    print(f"recording into {args.record_dir} (the demo's own folder; recordings/ stays yours)")
    try:
        replica = ReplicaThread(ReplicaConfig(tokenizer=args.tokenizer))
    except OSError as exc:
        print(f"error: cannot load the tokenizer {args.tokenizer!r} ({exc}).")
        print("Put the shared tokenizers beside the repository (../shared/tokenizers/qwen3), or name one in")
        print("TITO_DEMO_TOKENIZER (a local directory or a Hugging Face model name).")
        return 2
    with replica as backend:
        print(f"  listening at {backend.url}")
        proxy = Mitmdump(backend.url, tokenizer=args.tokenizer, record_dir=args.record_dir.resolve(), cwd=Path.cwd())
        print("mitmdump -s tito_addon/__init__.py --mode reverse:" + backend.url)
        with proxy:
            print(f"  listening at {proxy.url}; the agent runs {args.turns} turns through it:")
            run_agent(proxy.url, session_id, args.turns)
        generated = backend.generated()
    recorded = read_session(args.record_dir, session_id)
    if recorded is None:
        print(f"\nFAILED: nothing was recorded for session {session_id} in {args.record_dir}")
        return 1
    ids = recorded.full_ids()
    print(f"\nrecorded trajectory: {', '.join(str(path) for path in recorded.paths)}")
    previous: list[int] = []
    ok = len(recorded.turns) == len(generated) == args.turns
    for turn, gen in zip(recorded.turns, generated, strict=False):
        prompt, completion = ids[turn.turn_id]
        exact = prompt == gen["prompt_ids"] and completion == gen["completion_ids"]
        extends = prompt[: len(previous)] == previous
        ok = ok and exact and extends
        previous = prompt + completion
        print(
            f"  turn {turn.turn_id} (parent {turn.parent_turn_id}): prompt {len(prompt):5} ids "
            f"(+{len(turn.prompt_added_ids)} new), completion {len(completion):3} ids, "
            f"{'ids equal the backend’s' if exact else 'IDS DIFFER'}, "
            f"{'extends the previous turn' if extends else 'DOES NOT EXTEND'}"
        )
    last = recorded.turns[-1]
    print("\nlast turn, as recorded (ids truncated):")
    shown = last.model_dump(by_alias=True, include={"session_id", "turn_id", "parent_turn_id", "finish_reason"})
    shown["completion_ids"] = last.completion_ids[:12] + ["…"]
    shown["completion_logprobs"] = [round(x, 3) for x in last.completion_logprobs[:6]] + ["…"]
    print("  " + json.dumps(shown, ensure_ascii=False))
    verdict = "OK: every recorded turn is token-exact" if ok else "FAILED: the recording does not match the backend"
    print(f"\n{verdict} ({len(recorded.turns)} turns)")
    return 0 if ok else 1

"""What every tier of the suite shares: the repository and the workspace's `shared/` (the real tokenizers, HF hub names
when shared/ is absent), the tokenizers and engines built from them once per process, the chat tool set the tests'
conversations use and the message an openai-SDK agent appends, the API keys no recording may hold, the example count
of a generated sweep, and polling."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from hypothesis import settings

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("TITO_SHARED_DIR", REPO.parent / "shared"))
# The tool set of the conversations the tests drive (the drift cases use get_weather too).
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    },
]


def examples(count: int) -> int:
    """The example count for a sweep written for `count` under the ci profile: scaled by the loaded profile (the
    profiles are registered and the default loaded in conftest.py)."""
    return max(10, count * settings.default.max_examples // 100)


HUB_NAMES = {"qwen3": "Qwen/Qwen3-8B", "qwen2.5": "Qwen/Qwen2.5-7B-Instruct"}
# The API keys the tests send (long enough to be unmistakable); none may appear in a recording or a proxy log.
API_KEYS = (
    "sk-tito-test-SECRET-4f9a1c", "sk-agent", "sk-client", "sk-tito-crash-KEY-77e1", "sk-tito-conc-KEY-3b02",
    "sk-ep-ep-r", "sk-ep-node-episode", "sk-ep-cc-episode", "sk-ep-cx-ep", "backend-SECRET-key-9d2e",
)  # fmt: skip
# A header or key shape (`Authorization: …`, `"authorization": …`), not the word: real agents' system prompts say
# "authorization" in prose (Claude Code: "require clear authorization context"), and their text is recorded.
CREDENTIAL = re.compile(r"bearer\s+\S|authorization[\"']?\s*[:=]", re.IGNORECASE)


def echo(message) -> dict:
    """What a typical agent appends of an openai-SDK chat message: the standard fields only (reasoning is dropped,
    as openai-python does)."""
    out: dict = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls
        ]
    return out


def wait_until(condition, timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Polls `condition` until it holds or `timeout` seconds pass (a loaded machine: workers share the cores);
    returns its last value, for the caller to assert with its own message."""
    import time

    deadline = time.monotonic() + timeout
    while not (held := condition()) and time.monotonic() < deadline:
        time.sleep(interval)
    return bool(held)


def tokenizer_path(family: str) -> str:
    local = SHARED / "tokenizers" / family
    return str(local) if local.is_dir() else HUB_NAMES[family]


@functools.cache
def cached_tokenizer(family: str):
    from tito_addon.engine.tokenizer_loading import load_tokenizer

    return load_tokenizer(tokenizer_path(family), trust_remote_code=False)


@functools.cache
def cached_engine(tokenizer_family: str, family: str = "", roles: tuple[str, ...] = ("tool", "user", "system")):
    from tito_addon.engine.model_families import FAMILIES
    from tito_addon.engine.token_engine import TokenEngine

    return TokenEngine(
        cached_tokenizer(tokenizer_family),
        FAMILIES[family or tokenizer_family],
        append_roles=roles,
        tokenizer_name=tokenizer_path(tokenizer_family),
    )


def credential_leaks(text: str, where: str) -> list[str]:
    found = [f"{where}: API key {key!r}" for key in API_KEYS if key in text]
    found += [f"{where}: {match.group(0)!r} at {match.start()}" for match in CREDENTIAL.finditer(text)]
    return found

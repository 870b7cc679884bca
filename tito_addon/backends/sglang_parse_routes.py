"""A whole completion parsed once by the sglang server's own parsers, for a generation of several engine requests.

sglang's chat endpoint parses each request's output on its own: an attempt that resumes a cut generation starts in the
middle of a `<think>` block or a tool call, and its parse is meaningless. The proxy keeps the ids of every attempt, so
it asks the same server to do what its chat endpoint would have done over the whole completion, through the routes
sglang keeps for that (0.5.13 to 0.5.23 alike; ../shared/docs/weight-updates.md, sglang's `http_server.py`):
`/detokenize` (the text chat decodes: special tokens kept when tools are active, the matched stop id dropped, a matched
stop string cut), `/separate_reasoning` with the server's `reasoning_parser`, and `/parse_function_call` with its
`tool_call_parser`, both named by `/server_info`. The message is then assembled as sglang's `_build_chat_response`
does: the reasoning, what is left as content, each call with a fresh `call_` id, `finish_reason` `tool_calls` when
a call was found in a generation that stopped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tito_addon.backends.engine_failover import FailoverLog
from tito_addon.backends.upstream_client import UpstreamClient
from tito_addon.tito_errors import TitoError, UpstreamMalformed, UpstreamUnavailable

THINK_START = "<think>"


@dataclass(frozen=True)
class SglangServer:
    """What an sglang server says of itself at `/server_info`: its version and the parsers its chat endpoint runs."""

    version: tuple[int, ...] | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None


@dataclass(frozen=True)
class StitchedText:
    """The whole completion's ids as chat would decode them: `stop` is the stop text that ended it (a matched stop
    string, cut from the text), `drop_last` whether its last id is the matched stop token (never part of the text)."""

    ids: list[int]
    stop: str | None = None
    drop_last: bool = False


def tools_active(chat_body: dict[str, Any]) -> bool:
    return bool(chat_body.get("tools")) and chat_body.get("tool_choice") != "none"


class CompletionParser:
    """Parses one stitched completion through the server at `base_url` (with the turn's headers)."""

    def __init__(
        self,
        client: UpstreamClient,
        base_url: str,
        headers: dict[str, str],
        server: SglangServer,
        log: FailoverLog | None = None,
    ) -> None:
        self.client = client
        self.base_url = base_url
        self.headers = headers
        self.server = server
        self.log = log

    async def _route(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.client.post_json(self.base_url + path, body, self.headers, self.log)
        try:
            answer = response.json() if response.status == 200 else None
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise UpstreamMalformed(
                f"sglang's {path} answered {response.status} while parsing a completion its chat endpoint did not "
                f"(a resumed generation, or a turn with images): "
                f"{response.body[:200]!r}; nothing was recorded"
            )
        return answer

    async def text(self, stitched: StitchedText, chat_body: dict[str, Any]) -> str:
        ids = stitched.ids[:-1] if stitched.drop_last else stitched.ids
        if not ids:
            return ""
        # As chat decodes: special tokens are kept when the tool parser must see them.
        skip_special = not tools_active(chat_body)
        answer = await self._route("/detokenize", {"tokens": ids, "skip_special_tokens": skip_special})
        text = answer.get("text")
        if not isinstance(text, str):
            raise UpstreamMalformed("sglang's /detokenize answered without text; nothing was recorded")
        if stitched.stop:
            at = text.find(stitched.stop)
            text = text[:at] if at >= 0 else text
        return text

    async def message(
        self, stitched: StitchedText, chat_body: dict[str, Any], prompt_tail: str, finish: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """The assistant message chat would have answered for the whole completion, and its finish reason.
        `prompt_tail`: the end of the prompt's text (a template that opened the `<think>` block forces reasoning)."""
        text = await self.text(stitched, chat_body)
        reasoning: str | None = None
        if self.server.reasoning_parser and chat_body.get("separate_reasoning", True) is not False:
            forced = prompt_tail.rstrip().endswith(THINK_START) and not text.lstrip().startswith(THINK_START)
            shown = THINK_START + text if forced else text
            answer = await self._route(
                "/separate_reasoning", {"text": shown, "reasoning_parser": self.server.reasoning_parser}
            )
            reasoning, rest = answer.get("reasoning_text"), answer.get("text")
            if not isinstance(rest, str) or (reasoning is not None and not isinstance(reasoning, str)):
                raise UpstreamMalformed(
                    "sglang's /separate_reasoning answered an unexpected shape; nothing was recorded"
                )
            text = rest
        calls: list[dict[str, Any]] = []
        if tools_active(chat_body):
            text, calls = await self._tool_calls(text, chat_body)
        if calls and finish == "stop":
            finish = "tool_calls"
        message = {
            "role": "assistant",
            "content": text or None,
            "reasoning_content": reasoning or None,
            "tool_calls": calls or None,
        }
        return message, finish

    async def _tool_calls(self, text: str, chat_body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
        choice = chat_body.get("tool_choice")
        if choice == "required" or isinstance(choice, dict):
            # Constrained output is a JSON array of {name, parameters}, which sglang's chat reads itself.
            try:
                items = json.loads(text)
            except ValueError:
                items = None
            if isinstance(items, list) and all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
                found = [(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False)) for i in items]
                return "", [_call(index, name, args) for index, (name, args) in enumerate(found)]
        if not self.server.tool_call_parser:
            return text, []
        answer = await self._route(
            "/parse_function_call",
            {"text": text, "tool_call_parser": self.server.tool_call_parser, "tools": chat_body.get("tools") or []},
        )
        normal, items = answer.get("normal_text"), answer.get("calls")
        if not isinstance(normal, str) or not isinstance(items, list):
            raise UpstreamMalformed("sglang's /parse_function_call answered an unexpected shape; nothing was recorded")
        calls = []
        for index, item in enumerate(items):
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise UpstreamMalformed("sglang's /parse_function_call answered a call without a name")
            arguments = item.get("parameters")
            calls.append(_call(index, item["name"], arguments if isinstance(arguments, str) else "{}"))
        return normal, calls


def _call(index: int, name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "index": index,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


async def ask_server(client: UpstreamClient, base_url: str, headers: dict[str, str]) -> SglangServer:
    """The server's `/server_info` (or its older name): its version and parsers; an empty answer when neither says."""
    for route in ("/server_info", "/get_server_info"):
        try:
            response = await client.get(base_url + route, headers)
            info = response.json() if response.status == 200 else None
        except UpstreamUnavailable:
            raise  # nothing kept: the next turn asks again (an engine down at the first probe is not an old one)
        except (TitoError, ValueError):
            continue
        if isinstance(info, dict):
            return SglangServer(
                version_tuple(str(info.get("version", ""))),
                _name(info.get("reasoning_parser")),
                _name(info.get("tool_call_parser")),
            )
    return SglangServer()


def version_tuple(text: str) -> tuple[int, ...] | None:
    parts = re.findall(r"\d+", text)[:3]
    return tuple(int(p) for p in parts) if len(parts) >= 2 else None


def _name(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None

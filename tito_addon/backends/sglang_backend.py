"""sglang (>= 0.5.13): one chat-completion call that generates from our `input_ids`.

sglang's chat endpoint skips its own template when `input_ids` is given but still uses `messages`, `tools`
and `chat_template_kwargs` for its tool and reasoning parsers, so the agent's body goes along unchanged
apart from the forced fields. Completion ids and logprobs come from `meta_info.output_token_logprobs`, the turn's
weight version from `meta_info.weight_version`.
Older servers silently ignore `input_ids`. `input_ids` and the `prompt_token_ids` echo arrived together (0.5.13),
so the server's version, asked once, says whether it honours our ids; the full echo is then verified on the first
turn to each backend (and on every turn where the version is unknown, or when asked to), while every turn checks
the prompt length the server counted. Echoing a 150k-id prompt back on every turn cost more than everything else
the proxy does for that turn. A streamed turn keeps the same rule: the server's `sglext` block carries the input ids
only on the turns that would ask for the echo, and the usage chunk's prompt length is checked on every one.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

from tito_addon.backends.backend_protocol import (
    BackendResult,
    BackendTurn,
    StreamEnd,
    checked_ids,
    checked_logprobs,
    checked_message,
    stream_end,
    trajectory_message,
    weight_version_of,
)
from tito_addon.backends.parser_inputs import sglang_messages
from tito_addon.backends.server_facts import ServerFacts, ask_served_models
from tito_addon.backends.stream_accumulator import MessageAccumulator, clean_delta_chunk
from tito_addon.backends.upstream_client import UpstreamClient, dumps
from tito_addon.canonical_chat import ChatRequest
from tito_addon.tito_errors import TitoError, UpstreamMalformed, UpstreamPassthrough

logger = logging.getLogger(__name__)

STREAM_IDS_VERSION = (0, 5, 20)
INPUT_IDS_VERSION = (0, 5, 13)


def _version_tuple(text: str) -> tuple[int, ...] | None:
    parts = re.findall(r"\d+", text)[:3]
    return tuple(int(p) for p in parts) if len(parts) >= 2 else None


def metadata_weight_version(body: dict[str, Any]) -> str | None:
    """The response-level `metadata.weight_version` (a whole chat completion has it next to `meta_info`'s).

    sglang's chat stream chunks (`ChatCompletionStreamResponse`) declare no `metadata`, so a streamed turn usually
    records no weight version; one a server does send is read."""
    metadata = body.get("metadata")
    return weight_version_of(metadata.get("weight_version")) if isinstance(metadata, dict) else None


def with_input_ids(body: dict[str, Any], turn: BackendTurn) -> list[bytes]:
    """`body` as JSON with the prompt's ids spliced in as their ready text, in pieces, whole turn or streamed: they are
    sent as they are kept (see `PromptIds.json_pieces`), never listed, re-encoded or joined into one copy of a ~1 MB
    prompt."""
    head = dumps(body)  # (which holds no `input_ids` of the agent's: both callers drop them)
    return [head[:-1] + (b',"input_ids":[' if len(head) > 2 else b'"input_ids":['), *turn.prompt.json_pieces, b"]}"]


def check_counted(counted: Any, turn: BackendTurn) -> None:
    """The prompt length the server counted, where it said one, is the number of ids it was sent."""
    if counted is not None and counted != len(turn.prompt):
        raise UpstreamMalformed(
            f"backend counted {counted!r} prompt tokens for the {len(turn.prompt)} ids it was sent: it did not "
            "generate from our ids; nothing was recorded"
        )


class SglangBackend:
    kind = "sglang"

    def __init__(self, client: UpstreamClient, *, verify_echo: bool = False, compact_requests: bool = False) -> None:
        self.client = client
        self.verify_echo = verify_echo
        # Send only the messages sglang reads when given input_ids (`parser_inputs`), for the known families.
        self.compact_requests = compact_requests
        # None where neither server-info route said a version: kept, so the echo is then verified every turn.
        self.versions = ServerFacts(self._ask_version)
        self.models = ServerFacts(functools.partial(ask_served_models, client))
        self._echo_verified: set[str] = set()

    def check_request(self, request: ChatRequest) -> None:
        """sglang serves any valid chat request."""

    async def _ask_version(self, base_url: str, headers: dict[str, str]) -> tuple[int, ...] | None:
        """The server's version from its server-info route, under either of its names."""
        found: tuple[int, ...] | None = None
        for route in ("/server_info", "/get_server_info"):
            try:
                response = await self.client.get(base_url + route, headers)
                if response.status == 200:
                    found = _version_tuple(str(response.json().get("version", "")))
                    break
            except (TitoError, ValueError, AttributeError):
                continue
        logger.info("tito: %s speaks sglang %s", base_url, ".".join(map(str, found)) if found else "(unknown)")
        return found

    async def context_length(self, base_url: str, headers: dict[str, str]) -> int | None:
        return (await self.models.get(base_url, headers)).context_length

    async def can_stream(self, base_url: str, headers: dict[str, str]) -> bool:
        # Streamed output ids exist only in the sglext block (0.5.20+); before that a turn is re-framed.
        found = await self.versions.get(base_url, headers)
        return found is not None and found >= STREAM_IDS_VERSION

    async def stream_turn(self, turn: BackendTurn) -> AsyncIterator[dict[str, Any] | StreamEnd]:
        """A streamed chat completion on our `input_ids`; the ids it ran on and produced arrive in the final
        sglext block, the logprobs chunk by chunk."""
        echo = await self.must_echo(turn)
        dropped = ("stream_options", "return_meta_info", "return_input_ids_in_sglext", "input_ids")
        body = self.agent_fields(turn, dropped)
        body.update(logprobs=True, stream=True, stream_options={"include_usage": True})
        body["return_output_ids_in_sglext"] = True
        if echo:
            body["return_input_ids_in_sglext"] = True
        body.pop("return_prompt_token_ids", None)
        asked_logprobs = bool(turn.chat_body.get("logprobs"))
        values: list[Any] = []
        accumulated = MessageAccumulator()
        finish: str | None = None
        sglext: dict[str, Any] | None = None
        counted: Any = None
        weight: str | None = None
        base: dict[str, Any] = {}
        events = self.client.sse_events(turn.base_url + turn.chat_path, with_input_ids(body, turn), turn.headers)
        try:
            async for event in events:
                if "error" in event:
                    raise UpstreamMalformed(f"sglang stream failed: {str(event['error'])[:300]}")
                if isinstance(event.get("sglext"), dict):
                    sglext = event["sglext"]
                if isinstance(event.get("usage"), dict):
                    counted = event["usage"].get("prompt_tokens", counted)
                weight = metadata_weight_version(event) or weight
                base = base or {k: event.get(k) for k in ("id", "object", "created", "model")}
                parts = []
                for choice in event.get("choices") or []:
                    if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                        continue
                    entries = (choice.get("logprobs") or {}).get("content") or []
                    values += [entry.get("logprob") if isinstance(entry, dict) else None for entry in entries]
                    finish = choice.get("finish_reason") or finish
                    part = {**choice, "finish_reason": None}  # ours to send, after the commit
                    if not asked_logprobs:
                        part["logprobs"] = None
                    parts.append(part)
                if not parts:
                    continue
                chunk = {**event, "choices": parts}
                accumulated.add_chunk(chunk)
                cleaned = clean_delta_chunk(chunk)
                if cleaned is not None:
                    yield cleaned
        finally:
            await events.aclose()
        if sglext is None:
            raise UpstreamMalformed("sglang streamed no sglext ids block (0.5.20+ sends one when asked)")
        echoed = sglext.get("input_ids")
        if echoed is None and echo:
            raise UpstreamMalformed(
                "sglang streamed no input ids in its sglext block, so it cannot be shown to have generated from our "
                "ids; nothing was recorded"
            )
        if echoed is not None and echoed != turn.prompt_ids:
            raise UpstreamMalformed("sglang generated from different prompt ids than it was sent; nothing was recorded")
        check_counted(counted, turn)
        if echo:
            self._echo_verified.add(turn.base_url)
        outputs = sglext.get("output_ids")
        completion_ids = checked_ids(outputs[0] if isinstance(outputs, list) and outputs else None, "output ids")
        logprobs = checked_logprobs(values, len(completion_ids))
        yield stream_end(turn, base, accumulated.message(), finish, completion_ids, logprobs, weight=(weight, None))

    def agent_fields(self, turn: BackendTurn, dropped: tuple[str, ...]) -> dict[str, Any]:
        """The agent's body less `dropped`, its messages cut to what sglang reads where the family allows."""
        body = {k: v for k, v in turn.chat_body.items() if k not in dropped}
        if self.compact_requests and isinstance(body.get("messages"), list):
            body["messages"] = sglang_messages(body["messages"], body.get("continue_final_message"))
        return body

    def upstream_body(self, turn: BackendTurn, echo: bool = True) -> dict[str, Any]:
        """The agent's body with our fields forced; `input_ids` is spliced in by `upstream_payload`."""
        body = self.agent_fields(turn, ("stream_options", "input_ids"))
        body.update(logprobs=True, return_meta_info=True, stream=False)
        if echo:
            body["return_prompt_token_ids"] = True
        return body

    def upstream_payload(self, turn: BackendTurn, echo: bool = True) -> list[bytes]:
        """The request body in pieces: the prompt's ids go in as their ready JSON text, sent as they are kept
        (see `PromptIds.json_pieces`) instead of being re-encoded or joined into one copy of a ~1 MB prompt."""
        return with_input_ids(self.upstream_body(turn, echo), turn)

    async def must_echo(self, turn: BackendTurn) -> bool:
        """Whether this turn asks the server to echo its prompt ids (see the module docstring)."""
        found = await self.versions.get(turn.base_url, turn.headers)
        if found is not None and found < INPUT_IDS_VERSION:
            raise UpstreamMalformed(
                f"backend reports sglang {'.'.join(map(str, found))}, which silently ignores input_ids: "
                "sglang >= 0.5.13 is required; nothing was sent or recorded"
            )
        return (
            self.verify_echo
            or found is None
            or turn.base_url not in self._echo_verified
            or bool(turn.chat_body.get("return_prompt_token_ids"))
        )

    async def run_turn(self, turn: BackendTurn) -> BackendResult:
        url = turn.base_url + turn.chat_path
        echo = await self.must_echo(turn)
        response = await self.client.post_bytes(url, self.upstream_payload(turn, echo), turn.headers)
        if response.status != 200:
            raise UpstreamPassthrough(response.status, response.body, response.content_type)
        try:
            body = response.json()
        except ValueError as exc:
            raise UpstreamMalformed("backend answered 200 with a body that is not JSON") from exc
        result = self.harvest(body, turn, echo)
        if echo:
            self._echo_verified.add(turn.base_url)
        return result

    def harvest(self, body: Any, turn: BackendTurn, echo: bool = True) -> BackendResult:
        if not isinstance(body, dict):
            raise UpstreamMalformed("backend answered 200 with JSON that is not an object")
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise UpstreamMalformed("backend answered 200 without choices")
        choice = choices[0]
        echoed = choice.get("prompt_token_ids", body.get("prompt_token_ids"))
        if echoed is None and echo:
            raise UpstreamMalformed(
                "backend did not echo prompt_token_ids, so it cannot be shown to have generated from our ids: "
                "sglang >= 0.5.13 is required (older versions silently ignore input_ids)"
            )
        if echoed is not None and echoed != turn.prompt_ids:
            raise UpstreamMalformed(
                "backend generated from different prompt ids than it was sent: it ignored input_ids "
                "(sglang < 0.5.13 re-renders messages) or altered them; nothing was recorded"
            )
        meta = choice.get("meta_info")
        if not isinstance(meta, dict):
            raise UpstreamMalformed("backend answered without meta_info (sglang >= 0.5.13 is required)")
        counted = meta.get("prompt_tokens")
        if counted is None and isinstance(body.get("usage"), dict):
            counted = body["usage"].get("prompt_tokens")
        check_counted(counted, turn)
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list) or not entries:
            raise UpstreamMalformed("backend answered without meta_info.output_token_logprobs")
        if not all(isinstance(e, (list, tuple)) and len(e) >= 2 for e in entries):
            raise UpstreamMalformed("meta_info.output_token_logprobs entries are not [logprob, id, text]")
        completion_tokens = meta.get("completion_tokens")
        if type(completion_tokens) is not int or completion_tokens != len(entries):
            raise UpstreamMalformed(
                f"meta_info.completion_tokens ({completion_tokens!r}) does not match the {len(entries)} "
                "output_token_logprobs entries"
            )
        completion_ids = checked_ids([e[1] for e in entries], "completion token ids")
        logprobs = checked_logprobs([e[0] for e in entries], len(completion_ids))
        raw_message = choice.get("message")
        checked_message(raw_message)
        finish_reason = choice.get("finish_reason")
        if finish_reason is not None and not isinstance(finish_reason, str):
            raise UpstreamMalformed("backend returned a finish_reason that is not a string")
        return BackendResult(
            completion_ids=completion_ids,
            completion_logprobs=logprobs,
            message=trajectory_message(raw_message),
            finish_reason=finish_reason,
            agent_body=self.agent_body(body, turn.chat_body),
            usage=body.get("usage") if isinstance(body.get("usage"), dict) else None,
            weight_version=weight_version_of(meta.get("weight_version")) or metadata_weight_version(body),
        )

    @staticmethod
    def agent_body(body: dict[str, Any], chat_body: dict[str, Any]) -> dict[str, Any]:
        """The ordinary chat completion: fields we forced on and the agent did not ask for are removed."""
        cleaned = dict(body)
        choices = []
        for choice in body.get("choices", []):
            choice = dict(choice)
            if not chat_body.get("return_meta_info"):
                choice.pop("meta_info", None)
            if not chat_body.get("return_prompt_token_ids"):
                choice.pop("prompt_token_ids", None)
            if not chat_body.get("logprobs"):
                choice["logprobs"] = None
            choices.append(choice)
        cleaned["choices"] = choices
        if not chat_body.get("return_prompt_token_ids"):
            cleaned.pop("prompt_token_ids", None)
        return cleaned

"""sglang (>= 0.5.13): one chat-completion call that generates from our `input_ids`.

sglang's chat endpoint skips its own template when `input_ids` is given but still uses `messages`, `tools`
and `chat_template_kwargs` for its tool and reasoning parsers, so the agent's body goes along unchanged
apart from the forced fields. Completion ids and logprobs come from `meta_info.output_token_logprobs`, the turn's
weight version from `meta_info.weight_version` (and 0.5.20+ `meta_info.weight_versions`, its spans). A generation the
engine aborts for a weight update is resumed (`sglang_attempts`) and its whole completion parsed once by the server's
own parser routes (`sglang_parse_routes`).
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
from collections.abc import AsyncIterator, Sequence
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
    weight_spans_of,
    weight_version_of,
)
from tito_addon.backends.expert_routes import TurnRoutes, read_sglang
from tito_addon.backends.parser_inputs import sglang_messages
from tito_addon.backends.resumed_generation import (
    ABORT,
    DEFAULT_RESUME,
    Attempt,
    ResumePolicy,
    ResumeStats,
    StitchedGeneration,
    recorded_spans,
    stop_list,
)
from tito_addon.backends.server_facts import ServerFacts, ask_served_models
from tito_addon.backends.sglang_attempts import (
    ChatAttempt,
    attempt_pieces,
    check_counted,
    checked_attempt,
    metadata_weight_version,
    rest_of_message,
    resumed_body,
)
from tito_addon.backends.sglang_generate import (
    GENERATE_PATH,
    check_router,
    check_version,
    generate_attempt,
    generate_body,
    reframed,
)
from tito_addon.backends.sglang_parse_routes import CompletionParser, SglangServer, StitchedText, ask_server
from tito_addon.backends.stream_accumulator import MessageAccumulator, clean_delta_chunk
from tito_addon.backends.upstream_client import UpstreamClient, UpstreamResponse, dumps
from tito_addon.canonical_chat import ChatRequest
from tito_addon.tito_errors import UpstreamMalformed, UpstreamPassthrough

logger = logging.getLogger(__name__)

STREAM_IDS_VERSION = (0, 5, 20)
INPUT_IDS_VERSION = (0, 5, 13)


def with_input_ids(body: dict[str, Any], pieces: Sequence[bytes]) -> list[bytes]:
    """`body` as JSON with the prompt's ids spliced in as their ready text, in pieces, whole turn or streamed: they are
    sent as they are kept (see `PromptIds.json_pieces`), never listed, re-encoded or joined into one copy of a ~1 MB
    prompt."""
    head = dumps(body)  # (which holds no `input_ids` of the agent's: both callers drop them)
    return [head[:-1] + (b',"input_ids":[' if len(head) > 2 else b'"input_ids":['), *pieces, b"]}"]


def asked_routes(turn: BackendTurn) -> dict[str, Any]:
    """The fields that ask sglang (chat, 0.5.13+) for the turn's MoE routes, from where its session's end."""
    if turn.routes is None:
        return {}
    return {"return_routed_experts": True, "routed_experts_start_len": turn.routes.start}


def answer_of(response: UpstreamResponse, who: str) -> Any:
    """A 200 answer's JSON; any other status is passed on to the agent as the backend's own."""
    if response.status != 200:
        raise UpstreamPassthrough(response.status, response.body, response.content_type)
    try:
        return response.json()
    except ValueError as exc:
        raise UpstreamMalformed(f"{who} answered 200 with a body that is not JSON") from exc


class SglangBackend:
    kind = "sglang"

    def __init__(
        self,
        client: UpstreamClient,
        *,
        verify_echo: bool = False,
        compact_requests: bool = False,
        resume: ResumePolicy = DEFAULT_RESUME,
        resume_stats: ResumeStats | None = None,
        router: str = "none",
    ) -> None:
        self.client = client
        self.router = router
        self.verify_echo = verify_echo
        # Send only the messages sglang reads when given input_ids (`parser_inputs`), for the known families.
        self.compact_requests = compact_requests
        self.resume = resume
        self.resume_stats = resume_stats or ResumeStats()
        # A version of None where neither server-info route said one: kept, so the echo is then verified every turn.
        self.servers = ServerFacts(self._ask_server)
        self.models = ServerFacts(functools.partial(ask_served_models, client))
        self._echo_verified: set[str] = set()

    def check_request(self, request: ChatRequest) -> None:
        """sglang serves any valid chat request."""

    async def _ask_server(self, base_url: str, headers: dict[str, str]) -> SglangServer:
        found = await ask_server(self.client, base_url, headers)
        shown = ".".join(map(str, found.version)) if found.version else "(unknown)"
        logger.info("tito: %s speaks sglang %s", base_url, shown)
        return found

    async def context_length(self, base_url: str, headers: dict[str, str]) -> int | None:
        return (await self.models.get(base_url, headers)).context_length

    async def can_stream(self, base_url: str, headers: dict[str, str]) -> bool:
        # Streamed output ids exist only in the sglext block (0.5.20+); before that a turn is re-framed.
        found = (await self.servers.get(base_url, headers)).version
        return found is not None and found >= STREAM_IDS_VERSION

    def stitched(self, turn: BackendTurn) -> StitchedGeneration:
        routes = TurnRoutes(turn.routes, []) if turn.routes is not None else None
        return StitchedGeneration(turn.prompt_ids, self.resume, stats=self.resume_stats, routes=routes)

    async def stream_turn(self, turn: BackendTurn) -> AsyncIterator[dict[str, Any] | StreamEnd]:
        """A streamed chat completion on our `input_ids`; the ids it ran on and produced arrive in the final
        sglext block, the logprobs chunk by chunk. A generation the engine aborts (a weight update) goes on in whole
        requests, and the agent's stream continues with what the whole completion adds to what it was sent.
        A turn with images runs whole (`/generate` answers cumulative text, not the chat deltas) and is streamed as
        its finished message."""
        if turn.images:
            for event in reframed(turn, await self._image_turn(turn)):
                yield event
            return
        echo = await self.must_echo(turn)
        dropped = ("stream_options", "return_meta_info", "return_input_ids_in_sglext", "input_ids")
        body = self.agent_fields(turn, dropped)
        body.update(logprobs=True, stream=True, stream_options={"include_usage": True})
        body["return_output_ids_in_sglext"] = True
        if echo:
            body["return_input_ids_in_sglext"] = True
        body.pop("return_prompt_token_ids", None)
        body.update(asked_routes(turn))
        asked_logprobs = bool(turn.chat_body.get("logprobs"))
        values: list[Any] = []
        accumulated = MessageAccumulator()
        finish: str | None = None
        sglext: dict[str, Any] | None = None
        counted: Any = None
        weight: str | None = None
        base: dict[str, Any] = {}
        events = self.client.sse_events(
            turn.base_url + turn.chat_path, with_input_ids(body, turn.prompt.json_pieces), turn.headers, turn.failover
        )
        try:
            async for event in events:
                if "error" in event:
                    raise UpstreamMalformed(f"sglang stream failed: {str(event['error'])[:300]}")
                if isinstance(event.get("sglext"), dict):  # (the ids, and the routes, may come in chunks of their own)
                    sglext = {**(sglext or {}), **{k: v for k, v in event["sglext"].items() if v is not None}}
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
        if finish != ABORT:
            check_counted(counted, len(turn.prompt))  # (a waiting-queue abort counts no prompt)
        if echo:
            self._echo_verified.add(turn.base_url)
        outputs = sglext.get("output_ids")
        streamed = outputs[0] if isinstance(outputs, list) and outputs else None
        if finish == ABORT and streamed == []:
            completion_ids: list[int] = []
        else:
            completion_ids = checked_ids(streamed, "output ids")
        logprobs = checked_logprobs(values, len(completion_ids))
        stitched = self.stitched(turn)
        stitched.read_routes(read_sglang, sglext.get("routed_experts"), len(completion_ids), finish == ABORT)
        if finish != ABORT:
            end = stream_end(turn, base, accumulated.message(), finish, completion_ids, logprobs, weight=(weight, None))
            end.result.routes = stitched.routes
            yield end
            return
        finished = False
        try:
            stitched.cut(Attempt(completion_ids, logprobs, None))
            last, final = await self._continue(turn, stitched)
            message, final, stopped = await self._whole_message(turn, stitched, last, final)
            for delta in rest_of_message(accumulated.message(), message, stopped):
                rest: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
                if asked_logprobs:
                    rest["logprobs"] = {"content": stitched.entries}
                    asked_logprobs = False  # every continued token's entry, once
                yield {**base, "choices": [rest]}
            end = stream_end(
                turn, base, message, final, stitched.ids, stitched.logprobs, weight=recorded_spans(stitched.spans())
            )
            end.result.resumed = stitched.record()
            end.result.routes = stitched.routes
            finished = True
            yield end
        finally:
            stitched.end(finished)

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
        body.update(asked_routes(turn))
        return body

    def upstream_payload(self, turn: BackendTurn, echo: bool = True) -> list[bytes]:
        """The request body in pieces: the prompt's ids go in as their ready JSON text, sent as they are kept
        (see `PromptIds.json_pieces`) instead of being re-encoded or joined into one copy of a ~1 MB prompt."""
        return with_input_ids(self.upstream_body(turn, echo), turn.prompt.json_pieces)

    async def must_echo(self, turn: BackendTurn) -> bool:
        """Whether this turn asks the server to echo its prompt ids (see the module docstring)."""
        found = (await self.servers.get(turn.base_url, turn.headers)).version
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

    async def _attempt(
        self, turn: BackendTurn, body: dict[str, Any], pieces: Sequence[bytes], prompt_ids: list[int], echo: bool
    ) -> ChatAttempt:
        """One chat completion on `prompt_ids` (sent as `pieces`), checked."""
        response = await self.client.post_bytes(
            turn.base_url + turn.chat_path, with_input_ids(body, pieces), turn.headers, turn.failover
        )
        return checked_attempt(answer_of(response, "backend"), prompt_ids, echo)

    async def run_turn(self, turn: BackendTurn) -> BackendResult:
        if turn.images:
            return await self._image_turn(turn)
        echo = await self.must_echo(turn)
        attempt = await self._attempt(
            turn, self.upstream_body(turn, echo), turn.prompt.json_pieces, turn.prompt_ids, echo
        )
        if echo:
            self._echo_verified.add(turn.base_url)
        stitched = self.stitched(turn)
        stitched.read_routes(read_sglang, attempt.routes_text, len(attempt.ids), attempt.aborted)
        if not attempt.aborted:
            result = self.result(attempt, turn)
            result.routes = stitched.routes
            return result
        finished = False
        try:
            stitched.cut(attempt.kept())
            last, final = await self._continue(turn, stitched)
            message, final, _ = await self._whole_message(turn, stitched, last, final)
            result = self.stitched_result(turn, stitched, (attempt, last or attempt), message, final)
            result.routes = stitched.routes
            finished = True
            return result
        finally:
            stitched.end(finished)

    async def _image_turn(self, turn: BackendTurn) -> BackendResult:
        """A turn whose prompt holds images: `/generate` on our ids with every image (`sglang_generate`), resumed
        across weight updates like a chat turn, its whole completion parsed by the server's own parser routes."""
        check_router(self.router)
        check_version((await self.servers.get(turn.base_url, turn.headers)).version)
        stitched = self.stitched(turn)
        finished = False
        try:
            first: ChatAttempt | None = None
            last: ChatAttempt | None = None
            final = "length"
            while (body := generate_body(turn, stitched, turn.sampling_defaults)) is not None:
                prompt_ids = stitched.attempt_prompt()
                response = await self.client.post_json(turn.base_url + GENERATE_PATH, body, turn.headers, turn.failover)
                last = generate_attempt(answer_of(response, "sglang /generate"), turn, prompt_ids)
                first = first or last
                stitched.read_routes(read_sglang, last.routes_text, len(last.ids), last.aborted)
                if not last.aborted:
                    stitched.add(last.kept())
                    final = str(last.finish.get("type") or "stop")
                    break
                stitched.cut(last.kept())
            if first is None or last is None:
                raise UpstreamMalformed("sglang /generate was asked for no tokens; nothing was recorded")
            message, final, _ = await self._whole_message(turn, stitched, last, final)
            result = self.stitched_result(turn, stitched, (first, last), message, final)
            result.routes = stitched.routes
            finished = True
            return result
        finally:
            stitched.end(finished)

    async def _continue(self, turn: BackendTurn, stitched: StitchedGeneration) -> tuple[ChatAttempt | None, str]:
        """After a cut, whole attempts on `prompt + everything sampled` until the generation ends: the last attempt
        (None when the cut had spent the budget) and how it ended."""
        body = self.upstream_body(turn, echo=True)  # each attempt's prompt is shown to be the one it was sent
        while True:
            request = resumed_body(body, stitched)
            if request is None:
                return None, "length"
            attempt = await self._attempt(
                turn, request, attempt_pieces(turn, stitched), stitched.attempt_prompt(), True
            )
            stitched.read_routes(read_sglang, attempt.routes_text, len(attempt.ids), attempt.aborted)
            if not attempt.aborted:
                stitched.add(attempt.kept())
                return attempt, str(attempt.finish.get("type") or "stop")
            stitched.cut(attempt.kept())

    async def _whole_message(
        self, turn: BackendTurn, stitched: StitchedGeneration, last: ChatAttempt | None, finish: str
    ) -> tuple[dict[str, Any], str, bool]:
        """The message and finish reason of the whole generation, parsed once by the server's own parsers, and whether
        a stop string that straddles a cut (each attempt checked its own output only) ended it there."""
        stop: str | None = None
        drop_last = False
        matched = last.finish.get("matched") if last is not None and finish == "stop" else None
        if isinstance(matched, str):
            stop = matched
        elif type(matched) is int and stitched.ids and stitched.ids[-1] == matched:
            drop_last = True
        stops = stop_list(turn.chat_body.get("stop"))
        straddling = stitched.stop_cut(stops, turn.output_text) if turn.output_text is not None else None
        if straddling is not None:
            stitched.truncate(straddling[0])
            stop, finish, drop_last = straddling[1], "stop", False
        tail = turn.output_text(turn.prompt_ids[-4:]) if turn.output_text is not None else ""
        server = await self.servers.get(turn.base_url, turn.headers)
        parser = CompletionParser(self.client, turn.base_url, turn.headers, server, turn.failover)
        message, final = await parser.message(StitchedText(stitched.ids, stop, drop_last), turn.chat_body, tail, finish)
        checked_message(message)
        return message, final or finish, straddling is not None

    def stitched_result(
        self,
        turn: BackendTurn,
        stitched: StitchedGeneration,
        ends: tuple[ChatAttempt, ChatAttempt],
        message: dict[str, Any],
        finish: str,
    ) -> BackendResult:
        """One chat completion for the whole generation, under the first attempt's id, as an uncut one would read."""
        first, last = ends
        count = len(stitched.ids)
        meta = {**last.meta, "id": first.meta.get("id"), "prompt_tokens": len(turn.prompt), "completion_tokens": count,
                "finish_reason": {**last.finish, "type": finish}, "weight_versions": stitched.spans(),
                "output_token_logprobs": [[lp, i, None] for lp, i in zip(stitched.logprobs, stitched.ids, strict=True)],
                "output_token_logprobs_length": count}  # fmt: skip
        choice = {**last.choice, "message": message, "finish_reason": finish, "meta_info": meta,
                  "logprobs": {"content": stitched.entries}, "prompt_token_ids": turn.prompt_ids}  # fmt: skip
        body = {**last.body, "id": first.body.get("id"), "choices": [choice]}
        if isinstance(last.body.get("usage"), dict):
            prompt = len(turn.prompt)
            body["usage"] = {**last.body["usage"], "prompt_tokens": prompt, "completion_tokens": count,
                             "total_tokens": prompt + count}  # fmt: skip
        weight, spans = recorded_spans(stitched.spans())
        return BackendResult(
            completion_ids=stitched.ids,
            completion_logprobs=stitched.logprobs,
            message=trajectory_message(message),
            finish_reason=finish,
            agent_body=self.agent_body(body, turn.chat_body),
            usage=body.get("usage") if isinstance(body.get("usage"), dict) else None,
            weight_version=weight,
            weight_version_spans=spans,
            resumed=stitched.record(),
        )

    def harvest(self, body: Any, turn: BackendTurn, echo: bool = True) -> BackendResult:
        return self.result(checked_attempt(body, turn.prompt_ids, echo), turn)

    def result(self, attempt: ChatAttempt, turn: BackendTurn) -> BackendResult:
        """An uncut generation's result: the server's own answer and parse."""
        raw_message = attempt.choice.get("message")
        checked_message(raw_message)
        assert isinstance(raw_message, dict)
        finish_reason = attempt.choice.get("finish_reason")
        if finish_reason is not None and not isinstance(finish_reason, str):
            raise UpstreamMalformed("backend returned a finish_reason that is not a string")
        meta, body = attempt.meta, attempt.body
        version, spans = weight_spans_of(meta.get("weight_versions"), len(attempt.ids))
        return BackendResult(
            completion_ids=attempt.ids,
            completion_logprobs=attempt.logprobs,
            message=trajectory_message(raw_message),
            finish_reason=finish_reason,
            agent_body=self.agent_body(body, turn.chat_body),
            usage=body.get("usage") if isinstance(body.get("usage"), dict) else None,
            weight_version=version or weight_version_of(meta.get("weight_version")) or metadata_weight_version(body),
            weight_version_spans=spans,
        )

    @staticmethod
    def agent_body(body: dict[str, Any], chat_body: dict[str, Any]) -> dict[str, Any]:
        """The ordinary chat completion: fields we forced on and the agent did not ask for are removed."""
        cleaned = dict(body)
        choices = []
        own_routes = bool(chat_body.get("return_routed_experts"))  # the agent's own ask, not only ours
        if not own_routes and isinstance(body.get("sglext"), dict) and "routed_experts" in body["sglext"]:
            cleaned["sglext"] = {k: v for k, v in body["sglext"].items() if k != "routed_experts"}
        for choice in body.get("choices", []):
            choice = dict(choice)
            if not chat_body.get("return_meta_info"):
                choice.pop("meta_info", None)
            elif not own_routes and isinstance(choice.get("meta_info"), dict):
                choice["meta_info"] = {k: v for k, v in choice["meta_info"].items() if k != "routed_experts"}
            if not chat_body.get("return_prompt_token_ids"):
                choice.pop("prompt_token_ids", None)
            if not chat_body.get("logprobs"):
                choice["logprobs"] = None
            choices.append(choice)
        cleaned["choices"] = choices
        if not chat_body.get("return_prompt_token_ids"):
            cleaned.pop("prompt_token_ids", None)
        return cleaned

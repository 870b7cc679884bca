"""vLLM's generate step on our ids: the response checked, and the attempts it takes when a weight update aborts it.

`/inference/v1/generate` runs on the exact prompt ids and returns the exact completion ids and log-probs (whole, or
streamed chunk by chunk). When the trainer pauses the engine in `abort` mode, the generation ends with
`finish_reason: "abort"` and the tokens it has (../shared/docs/weight-updates.md §2.3): it goes on as a new request on
`prompt + partial` (`resumed_generation`), and the attempts reach derender, the agent and the record as one
generation. 0.32+ reports each attempt's `weight_versions`; they are shifted and merged over the whole completion.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from tito_addon.backends.backend_protocol import BackendTurn, checked_ids, checked_logprobs
from tito_addon.backends.engine_failover import FailoverLog
from tito_addon.backends.expert_routes import RoutesRead, TurnRoutes, read_vllm, without_routes
from tito_addon.backends.resumed_generation import (
    ABORT,
    Attempt,
    ResumePolicy,
    ResumeStats,
    StitchedGeneration,
    attempt_spans,
    fresh_request_id,
    stop_list,
)
from tito_addon.backends.upstream_client import StreamCut, UpstreamClient
from tito_addon.tito_errors import UpstreamMalformed

GENERATE_PATH = "/inference/v1/generate"
_TOKEN_ID_STRING = re.compile(r"^token_id:(\d+)$")

#: POST a JSON body to the backend, named for its step in errors: the parsed object and the raw bytes.
Call = Callable[[str, dict[str, Any], dict[str, str], str, FailoverLog], Awaitable[tuple[dict[str, Any], bytes]]]


class VllmGeneration:
    """The generate step of one backend: whole (`run`) or streamed (`events`), resumed across aborts."""

    def __init__(self, client: UpstreamClient, call: Call, resume: ResumePolicy, stats: ResumeStats) -> None:
        self.client = client
        self.call = call
        self.resume = resume
        self.stats = stats

    def stitched(self, turn: BackendTurn) -> StitchedGeneration:
        routes = TurnRoutes(turn.routes, []) if turn.routes is not None else None
        return StitchedGeneration(turn.prompt_ids, self.resume, stats=self.stats, routes=routes)

    async def run(self, turn: BackendTurn, request: dict[str, Any]) -> tuple[dict[str, Any], StitchedGeneration]:
        """The generate response for the turn: the backend's own, or, when it aborted the generation (a weight
        update), the attempts it took to finish laid end to end as one response (`resumed_generation`)."""
        stitched = self.stitched(turn)
        finished = False
        try:
            response = await self._attempts(turn, request, stitched)
            finished = True
            return response, stitched
        finally:
            stitched.end(finished)

    async def _attempts(
        self, turn: BackendTurn, request: dict[str, Any], stitched: StitchedGeneration
    ) -> dict[str, Any]:
        url = turn.base_url + GENERATE_PATH
        attempt_request: dict[str, Any] | None = request
        first: dict[str, Any] | None = None
        while attempt_request is not None:
            generated, _ = await self.call(url, attempt_request, turn.headers, "generate", turn.failover)
            first = first or generated
            choice = first_choice(generated)
            aborted = choice.get("finish_reason") == ABORT
            if not aborted and not stitched.resumed:
                attempt_routes(stitched, choice, len(choice.get("token_ids") or []), False)
                return generated
            ids, values, finish = harvest_generate(generated, stitched.attempt_prompt(), may_be_empty=aborted)
            attempt_routes(stitched, choice, len(ids), aborted)
            entries = (choice.get("logprobs") or {}).get("content") or []
            attempt = Attempt(ids, values, attempt_spans(choice.get("weight_versions"), len(ids)), list(entries))
            if not aborted:
                stitched.add(attempt)
                break
            stitched.cut(attempt)
            attempt_request = resumed_request(request, stitched)
            finish = "length"  # unless another attempt runs: the budget was spent before the cut
        assert first is not None
        stopped = stitched.stop_cut(stop_strings(request), turn.output_text) if turn.output_text else None
        if stopped is not None:
            stitched.truncate(stopped[0])
            finish = "stop"
        response = stitched_response(first, generated, stitched, finish, turn.prompt_ids)
        if stopped is not None:
            response["choices"][0]["stop_reason"] = stopped[1]
        return response

    async def _fail_over(self, turn: BackendTurn, cut: StreamCut) -> None:
        """Before a cut stream goes on from its tokens: within the failover policy's retries, else the cut's error."""
        retry = len(turn.failover.errors)
        if retry >= self.client.failover.retries:
            raise cut
        await self.client.fail_over(turn.failover, cut.message, retry)

    async def events(
        self, turn: BackendTurn, request: dict[str, Any], stitched: StitchedGeneration
    ) -> AsyncIterator[dict[str, Any]]:
        """The generate stream of the turn, across the attempts it takes when the backend aborts it (a weight update):
        an aborted attempt's last chunk goes on without its finish, and the next attempt's chunks follow, so the
        derender stream (and the agent's) runs on as if nothing was cut. The final chunk carries the spans of all."""
        url = turn.base_url + GENERATE_PATH
        attempt_request: dict[str, Any] | None = request
        last: dict[str, Any] = {}
        finished = False
        stops = stop_strings(request) if turn.output_text is not None else []
        try:
            while attempt_request is not None:
                expected = stitched.attempt_prompt()
                ids: list[int] = []
                spans: Any = None
                aborted = False
                stopped: tuple[int, str] | None = None  # a stop string straddling the cut ended the generation
                ended = False  # the attempt's final chunk arrived: what may follow is only the usage and [DONE]
                events = self.client.sse_events(url, attempt_request, turn.headers, turn.failover)
                try:
                    async for event in events:
                        last = event
                        echoed = event.get("prompt_token_ids")
                        if echoed is not None and echoed != expected:
                            raise UpstreamMalformed("vLLM generate ran on different prompt ids than it was sent")
                        if stitched.resumed and echoed is not None:
                            event = {**event, "prompt_token_ids": None}  # checked here, against this attempt's prompt
                        choice = (event.get("choices") or [None])[0]
                        if not isinstance(choice, dict):
                            if stopped is None:
                                yield event
                            continue
                        delta = choice.get("token_ids") or []
                        ids += delta
                        finish = choice.get("finish_reason")
                        if stopped is None and stops and delta and stitched.resumed:
                            assert turn.output_text is not None
                            stopped = stitched.stop_within(ids, stops, turn.output_text)
                            if stopped is not None:  # this chunk's tokens up to the stop go on; the rest never do
                                yield cut_chunk(event, choice, len(delta) - (len(ids) - stopped[0]))
                        if finish is None:
                            if stopped is None:
                                yield event
                            continue
                        spans = attempt_spans(choice.get("weight_versions"), len(ids))
                        attempt_routes(stitched, choice, len(ids), finish == ABORT, True)
                        if choice.get("routed_experts") is not None:  # read: derender and the agent never need them
                            choice = without_routes(choice)
                            event = {**event, "choices": [choice, *event["choices"][1:]]}
                        if stopped is not None:  # the attempt's end, read for its spans: the generation ends there
                            stitched.add(Attempt(ids, [], spans))
                            stitched.truncate(len(stitched.ids) - len(ids) + stopped[0])
                            final = {"index": 0, "finish_reason": "stop", "stop_reason": stopped[1], "token_ids": [],
                                     "logprobs": {"content": []}, "weight_versions": stitched.spans()}  # fmt: skip
                            yield {**event, "usage": None, "prompt_token_ids": None, "choices": [final]}
                            break
                        if finish == ABORT:
                            aborted = True
                            if choice.get("token_ids"):
                                cut = {**choice, "finish_reason": None, "stop_reason": None, "weight_versions": None}
                                yield {**event, "choices": [cut]}
                            continue
                        ended = True
                        if stitched.resumed:
                            stitched.add(Attempt(ids, [], spans))
                            event = {**event, "choices": [{**choice, "weight_versions": stitched.spans()}]}
                        yield event
                except StreamCut as cut:
                    # An engine died mid-stream: its tokens so far reached the agent, so the generation goes on from
                    # them on another engine, as after a weight update's abort (`engine_failover`).
                    if not ended and stopped is None:
                        await self._fail_over(turn, cut)
                        aborted = True
                finally:
                    await events.aclose()
                if not aborted:
                    finished = True
                    return
                stitched.cut(Attempt(ids, [], spans))
                attempt_request = resumed_request(request, stitched)
            # The budget was spent before the last cut: the generation ends there, as one cut by its length.
            final = {"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [],
                     "logprobs": {"content": []}, "weight_versions": stitched.spans()}  # fmt: skip
            yield {**last, "usage": None, "prompt_token_ids": None, "choices": [final]}
            finished = True
        finally:
            stitched.end(finished)


def cut_chunk(event: dict[str, Any], choice: dict[str, Any], keep: int) -> dict[str, Any]:
    """A generate chunk cut to its first `keep` tokens (a stop string ends there), without a finish."""
    entries = ((choice.get("logprobs") or {}).get("content") or [])[:keep]
    part = {**choice, "token_ids": (choice.get("token_ids") or [])[:keep], "logprobs": {"content": entries},
            "finish_reason": None, "stop_reason": None, "weight_versions": None}  # fmt: skip
    return {**event, "usage": None, "choices": [part]}


def attempt_routes(
    stitched: StitchedGeneration, choice: dict[str, Any], sampled: int, aborted: bool, streamed: bool = False
) -> None:
    """The routes of one generate answer, read before the attempt is added (its prompt is the attempt's)."""
    text = choice.get("routed_experts")
    if streamed and text is None and not (aborted and sampled == 0) and stitched.routes_start is not None:
        stitched.add_routes(RoutesRead(None, "vLLM's generate stream carried no routed experts"))
    stitched.read_routes(read_vllm, text, sampled, aborted)


def resumed_request(request: dict[str, Any], stitched: StitchedGeneration) -> dict[str, Any] | None:
    """The next attempt: generate on the prompt and everything sampled so far, under a new request id, with the
    budgets less what was sampled (and its routes asked from where the last attempt's ended); None when no token is
    left to sample."""
    sampling = dict(request["sampling_params"])
    for key in ("max_tokens", "min_tokens"):
        if key in sampling:
            sampling[key] = stitched.left_of(sampling[key])
    if sampling.get("max_tokens") == 0:
        return None
    if stitched.routes_start is not None:
        sampling["routed_experts_prompt_start"] = stitched.routes_start
    return {**request, "token_ids": stitched.attempt_prompt(), "request_id": fresh_request_id(),
            "sampling_params": sampling}  # fmt: skip


def stitched_response(
    first: dict[str, Any], last: dict[str, Any], stitched: StitchedGeneration, finish: Any, prompt_ids: list[int]
) -> dict[str, Any]:
    """One generate response for the whole generation, as derender and the record read it (under the first
    attempt's request id: the reply's id is made from it, and must not show the cut)."""
    choice = {
        **first_choice(last),  # (its routes, read, go with the response: `without_choice_routes` takes them out)
        "token_ids": stitched.ids,
        "logprobs": {"content": stitched.entries},
        "finish_reason": finish,
        "weight_versions": stitched.spans(),
    }
    if finish != "stop":
        choice["stop_reason"] = None
    response = {**last, "choices": [choice], "request_id": first.get("request_id", last.get("request_id"))}
    if last.get("prompt_token_ids") is not None:
        response["prompt_token_ids"] = prompt_ids
    if isinstance(last.get("usage"), dict):
        prompt, completion = len(prompt_ids), len(stitched.ids)
        response["usage"] = {**last["usage"], "prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}  # fmt: skip
    return response


def harvest_generate(
    generated: dict[str, Any], prompt_ids: list[int], may_be_empty: bool = False
) -> tuple[list[int], list[float], Any]:
    """The completion ids, their log-probs and the finish reason, checked; `may_be_empty`: an aborted attempt
    (cut before its first token)."""
    choice = first_choice(generated)
    echoed = generated.get("prompt_token_ids")
    if echoed is not None and echoed != prompt_ids:
        raise UpstreamMalformed("vLLM generate ran on different prompt ids than it was sent; nothing was recorded")
    if may_be_empty and choice.get("token_ids") == []:
        return [], [], choice.get("finish_reason")
    completion_ids = checked_ids(choice.get("token_ids"), "completion token ids")
    block = choice.get("logprobs")
    entries = block.get("content") if isinstance(block, dict) else None
    if not isinstance(entries, list):
        raise UpstreamMalformed("vLLM generate answered without logprobs (the chain forces logprobs on)")
    if len(entries) != len(completion_ids):
        raise UpstreamMalformed(
            f"vLLM generate returned {len(entries)} logprobs for {len(completion_ids)} completion tokens"
        )
    values = []
    for position, (entry, token_id) in enumerate(zip(entries, completion_ids, strict=True)):
        if not isinstance(entry, dict):
            raise UpstreamMalformed("vLLM generate returned a logprob entry that is not an object")
        if _entry_token_id(entry) not in (None, token_id):
            raise UpstreamMalformed(f"vLLM generate logprob {position} is for another token than token_ids says")
        values.append(entry.get("logprob"))
    return completion_ids, checked_logprobs(values, len(completion_ids)), choice.get("finish_reason")


def first_choice(generated: dict[str, Any]) -> dict[str, Any]:
    choices = generated.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise UpstreamMalformed("vLLM generate answered without choices")
    return choices[0]


def stop_strings(request: dict[str, Any]) -> list[str]:
    return stop_list((request.get("sampling_params") or {}).get("stop"))


def checked_stream_choice(choice: dict[str, Any]) -> list[Any]:
    """The logprob values of one streamed generate choice, after checking its ids and their logprob entries."""
    delta_ids = choice.get("token_ids") or []
    if not isinstance(delta_ids, list) or not all(type(i) is int and i >= 0 for i in delta_ids):
        raise UpstreamMalformed("vLLM generate streamed token ids that are not non-negative integers")
    entries = (choice.get("logprobs") or {}).get("content")
    if not isinstance(entries, list) or len(entries) != len(delta_ids):
        raise UpstreamMalformed("vLLM generate streamed a chunk whose logprobs do not match its ids")
    for entry, token_id in zip(entries, delta_ids, strict=True):
        if not isinstance(entry, dict) or _entry_token_id(entry) not in (None, token_id):
            raise UpstreamMalformed("vLLM generate streamed a logprob for another token")
    return [entry.get("logprob") for entry in entries]


def _entry_token_id(entry: dict[str, Any]) -> int | None:
    """The token id a logprob entry is about: 0.32+ `token_id`, earlier `"token": "token_id:N"`."""
    value = entry.get("token_id")
    if type(value) is int:
        return value
    token = entry.get("token")
    if isinstance(token, str):
        match = _TOKEN_ID_STRING.match(token)
        if match:
            return int(match.group(1))
    return None

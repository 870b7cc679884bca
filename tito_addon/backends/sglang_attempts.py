"""One sglang chat completion on our ids, checked, and what resuming a cut generation needs of it.

A weight update's abort reaches a chat completion as HTTP 200 with `finish_reason: "abort"` and, in `meta_info`, the
tokens sampled so far with their log-probs and (0.5.20+) version spans (../shared/docs/weight-updates.md §1.2; the
chat path with `input_ids` and `return_meta_info` carries them from 0.5.13). The next attempt is the same request on
`prompt + partial` under a fresh rid with its budgets reduced; a streamed agent is then brought from the message it
was sent to the whole one by deltas (`rest_of_message`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tito_addon.backends.backend_protocol import BackendTurn, checked_ids, checked_logprobs, weight_version_of
from tito_addon.backends.resumed_generation import (
    ABORT,
    Attempt,
    StitchedGeneration,
    attempt_spans,
    fresh_request_id,
)
from tito_addon.engine.prompt_ids import JsonPieces, extended
from tito_addon.tito_errors import UpstreamMalformed

#: The chat body's token budgets, each less what was sampled when a cut generation is resumed.
BUDGETS = ("max_tokens", "max_completion_tokens", "min_tokens")


def metadata_weight_version(body: dict[str, Any]) -> str | None:
    """The response-level `metadata.weight_version` (a whole chat completion has it next to `meta_info`'s).

    sglang's chat stream chunks (`ChatCompletionStreamResponse`) declare no `metadata`, so a streamed turn usually
    records no weight version; one a server does send is read."""
    metadata = body.get("metadata")
    return weight_version_of(metadata.get("weight_version")) if isinstance(metadata, dict) else None


def check_counted(counted: Any, sent: int) -> None:
    """The prompt length the server counted, where it said one, is the number of ids it was sent."""
    if counted is not None and counted != sent:
        raise UpstreamMalformed(
            f"backend counted {counted!r} prompt tokens for the {sent} ids it was sent: it did not "
            "generate from our ids; nothing was recorded"
        )


@dataclass
class ChatAttempt:
    """One chat completion on our ids, checked: its body and choice, the ids it generated with their log-probs (and
    the entries they came in), its `meta_info.finish_reason`, and whether the engine aborted it."""

    body: dict[str, Any]
    choice: dict[str, Any]
    meta: dict[str, Any]
    ids: list[int]
    logprobs: list[float]
    meta_entries: list[Any]
    finish: dict[str, Any] = field(default_factory=dict)

    @property
    def aborted(self) -> bool:
        return self.finish.get("type") == ABORT

    @property
    def routes_text(self) -> Any:
        """Its MoE routes as sglang sent them: in `meta_info` where it was asked for (0.5.23 puts them only there),
        else in the response's `sglext`."""
        text = self.meta.get("routed_experts")
        sglext = self.body.get("sglext")
        if text is None and isinstance(sglext, dict):
            text = sglext.get("routed_experts")
        return text

    def kept(self) -> Attempt:
        """What the stitched generation keeps of it: its tokens, log-probs, spans and OpenAI log-prob entries."""
        count = len(self.ids)
        spans = attempt_spans(self.meta.get("weight_versions"), count)
        version = weight_version_of(self.meta.get("weight_version")) or metadata_weight_version(self.body)
        if spans is None and version is not None and count:
            spans = [{"version": version, "start": 0, "end": count}]  # a single label: the attempt's, as reported
        entries = (self.choice.get("logprobs") or {}).get("content") or []
        return Attempt(self.ids, self.logprobs, spans, list(entries) if len(entries) == count else [])


def resumed_body(body: dict[str, Any], stitched: StitchedGeneration) -> dict[str, Any] | None:
    """The next attempt's fields: a fresh request id (sglang aborts ids by prefix), the budgets less what was sampled,
    its routes asked from where the last attempt's ended; None when no token is left to sample."""
    resumed = {**body, "rid": fresh_request_id()}
    for key in BUDGETS:
        if key in resumed and resumed[key] is not None:
            resumed[key] = stitched.left_of(resumed[key])
    if any(resumed.get(key) == 0 for key in ("max_tokens", "max_completion_tokens")):
        return None
    if stitched.routes is not None:
        start = stitched.routes_start  # from where the last attempt's routes ended; a gap asks for none
        resumed["return_routed_experts"] = start is not None
        resumed["routed_experts_start_len"] = start or 0
    return resumed


def attempt_pieces(turn: BackendTurn, stitched: StitchedGeneration) -> JsonPieces:
    """The next attempt's prompt as JSON pieces: the turn's, then everything sampled so far."""
    return extended(tuple(turn.prompt.json_pieces), stitched.ids)


def rest_of_message(sent: dict[str, Any], whole: dict[str, Any], stopped: bool = False) -> list[dict[str, Any]]:
    """The deltas that take a streamed agent from the message it has (`sent`: the attempt before the cut) to the whole
    one; the whole message's calls keep the ids the agent already has. Where the whole parse contradicts what was
    sent (text the agent read as content is reasoning over the whole completion), nothing can be taken back: refused.
    `stopped`: a stop string that straddles the cut ended the generation, and the agent may have been sent the part of
    it before the cut: it keeps that text, and `whole` (what is recorded) says what the agent has."""
    deltas: list[dict[str, Any]] = []
    for key in ("reasoning_content", "content"):
        have, want = sent.get(key) or "", whole.get(key) or ""
        if stopped and have.startswith(want):
            whole[key] = have or None
            continue
        if not want.startswith(have):
            raise UpstreamMalformed(
                f"the resumed generation's {key} does not continue what the agent was streamed before the cut; "
                "nothing was recorded"
            )
        if want[len(have) :]:
            deltas.append({key: want[len(have) :]})
    have_calls, calls = sent.get("tool_calls") or [], whole.get("tool_calls") or []
    if len(have_calls) > len(calls):
        raise UpstreamMalformed("the agent was streamed a tool call the resumed generation does not make")
    for index, call in enumerate(calls):
        function = call["function"]
        if index >= len(have_calls):
            named = {"name": function["name"], "arguments": ""}
            deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function", "function": named}]})
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": function["arguments"]}}]})
            continue
        had = have_calls[index]
        name, arguments = had["function"].get("name") or "", had["function"].get("arguments") or ""
        if name != function["name"] or not function["arguments"].startswith(arguments):
            raise UpstreamMalformed(
                "the resumed generation's tool call does not continue the one the agent was streamed"
            )
        call["id"] = had.get("id") or call["id"]
        if function["arguments"][len(arguments) :]:
            deltas.append(
                {"tool_calls": [{"index": index, "function": {"arguments": function["arguments"][len(arguments) :]}}]}
            )
    return deltas


def checked_attempt(body: Any, prompt_ids: list[int], echo: bool) -> ChatAttempt:
    """A chat completion's answer checked against the ids it was sent: an aborted one (a weight update) may have
    generated nothing and carry an empty message; an abort with an error status is the server's error, not a cut."""
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
    if echoed is not None and echoed != prompt_ids:
        raise UpstreamMalformed(
            "backend generated from different prompt ids than it was sent: it ignored input_ids "
            "(sglang < 0.5.13 re-renders messages) or altered them; nothing was recorded"
        )
    meta = choice.get("meta_info")
    if not isinstance(meta, dict):
        raise UpstreamMalformed("backend answered without meta_info (sglang >= 0.5.13 is required)")
    said = meta.get("finish_reason")
    finish: dict[str, Any] = said if isinstance(said, dict) else {}
    aborted = finish.get("type") == ABORT or choice.get("finish_reason") == ABORT
    if aborted and finish.get("status_code") is not None:
        raise UpstreamMalformed(
            f"sglang aborted the generation with status {finish.get('status_code')!r}: "
            f"{str(finish.get('message'))[:200]}; nothing was recorded"
        )
    if aborted:
        finish = {**finish, "type": ABORT}
    counted = meta.get("prompt_tokens")
    if counted is None and isinstance(body.get("usage"), dict):
        counted = body["usage"].get("prompt_tokens")
    if not (aborted and not counted):  # (an abort in the waiting queue counts no prompt)
        check_counted(counted, len(prompt_ids))
    entries = meta.get("output_token_logprobs")
    if aborted and entries in (None, []) and meta.get("completion_tokens") in (None, 0):
        return ChatAttempt(body, choice, meta, [], [], [], finish)
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
    return ChatAttempt(body, choice, meta, completion_ids, logprobs, entries, finish)

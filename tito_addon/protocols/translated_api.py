"""The template of an agent API translated to the canonical chat form: Anthropic Messages and OpenAI Responses fill
it in, and so would the next one (Gemini's generateContent).

Reading a request is one pipeline, written here once (`TranslatedApi.parse`):
1. the body, read as a request this API read before plus what its agent appended (`known_requests`, its own memo);
2. validation of what was appended only (the known items were validated when they were read); a refusal is told by
   validating the whole request, so its words are always the same;
3. the translation: the items before the conversation (a system prompt, instructions: `begin`), the known items'
   translation taken as it was (`resume`), each appended item's (`translate_item`), then what depends on them all
   (`close`: which thinking signatures are checked);
4. the chat body: the API's own fields (`fill`: tools, tool choice, sampling, what the prompt leaves out of them)
   and the backend extensions; the chat form validated, the known items' validated messages taken as they are;
5. the request remembered with this reading of its items (`reading`), and the `AgentRequest`, with the thinking
   switch and what the prompt leaves out, of the conversation first.

Where each native item translates on its own (Anthropic's messages, Gemini's contents), the reading kept is one
`ItemTranslation` per item, so a request is also known up to each of its last items (an agent may rewrite its last
one) and an API supplies only `translate_one`. OpenAI Responses, whose assistant-side items join into one message,
keeps one reading of them all instead (its own `resume`, `translate_item` and `reading`).

`TranslatedResponder` is the reply's side: the stream made from a finished message, and each canonical chunk's
reasoning, text and tool-call deltas handed to the API's stream writer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tito_addon.canonical_chat import BoundedRequest, ChatMessage, ChatRequest, json_value_problem
from tito_addon.protocols.agent_api import (
    EVENT_STREAM_HEADERS,
    AgentRequest,
    ReplyContext,
    Route,
    TurnOutcome,
    backend_extensions,
    chunks_from_message,
    with_known_chat,
)
from tito_addon.protocols.compaction_items import COMPACT_ENDPOINT, SERVED_COMPACTION_PROMPT
from tito_addon.protocols.json_body import validated
from tito_addon.protocols.known_messages import DEFAULT_BUDGET_BYTES
from tito_addon.protocols.known_requests import Extension, KnownRequests
from tito_addon.protocols.turn_refs import TurnSigner
from tito_addon.tito_errors import BadRequest, TitoError, UpstreamPassthrough

Signature = tuple[str, str, str]  # where, the signed value, the text it stands for


@dataclass(frozen=True, slots=True)
class ItemTranslation:
    """What one native item becomes, where items translate on their own: its canonical messages, what of it the
    prompt leaves out, its signed values (None: it holds none, and leaves the newest ones as they were: only those
    are checked), and its messages validated (filled once the request's chat form is)."""

    messages: tuple[dict[str, Any], ...]
    dropped: tuple[str, ...]
    signatures: tuple[Signature, ...] | None
    chat: tuple[ChatMessage, ...] = ()
    # A compaction block's: the reply whose summary it carries. Everything before it is dropped (`cut_at`).
    compaction: str | None = None


@dataclass(frozen=True, slots=True, eq=False)
class ReadItems:
    """The reading kept of a request's items, where items translate on their own: each item's translation, and what
    taking them adds laid out whole (their messages, the item each came from, what they leave out, their messages
    validated). Each is extended from the reading its request took, so a turn of a long conversation takes its known
    items in a few copies, not in a loop over hundreds of them; one holds no compaction (a request with one is not
    remembered)."""

    units: tuple[ItemTranslation, ...]
    first: int  # the item the first unit translates
    messages: tuple[dict[str, Any], ...]
    item_of: tuple[int, ...]  # per message, its item
    dropped: tuple[str, ...]
    chat: tuple[ChatMessage, ...]
    # Per unit: how many messages and dropped notes the units up to it hold, and the last of them that holds
    # signatures (-1: none), so the reading of the first n is a slice of each.
    message_ends: tuple[int, ...]
    dropped_ends: tuple[int, ...]
    signed: tuple[int, ...]

    @staticmethod
    def of(translation: ChatTranslation, chat: Sequence[ChatMessage], leading: int, first: int) -> ReadItems:
        """The reading of a translation's units (`chat`: their messages validated), extending the one it resumed."""
        base = translation.resumed or EMPTY_READ
        if base.first != first:
            base = EMPTY_READ  # (the items before the conversation changed: every unit is read anew)
        taken = len(base.units)
        units, message_ends = list(base.units), list(base.message_ends)
        dropped_ends, signed = list(base.dropped_ends), list(base.signed)
        at, last = len(base.messages), base.signed[-1] if base.signed else -1
        notes = list(base.dropped)
        for index, unit in enumerate(translation.units[taken:], taken):
            count = len(unit.messages)
            units.append(unit if unit.chat else replace(unit, chat=tuple(chat[at : at + count])))
            at += count
            notes += unit.dropped
            last = index if unit.signatures is not None else last
            message_ends.append(at)
            dropped_ends.append(len(notes))
            signed.append(last)
        start = leading + len(base.messages)
        return ReadItems(
            tuple(units),
            first,
            base.messages + tuple(translation.messages[start : leading + at]),
            base.item_of + tuple(translation.item_of[start : leading + at]),
            tuple(notes),
            base.chat + tuple(chat[len(base.chat) : at]),
            tuple(message_ends),
            tuple(dropped_ends),
            tuple(signed),
        )

    def first_units(self, n: int) -> ReadItems:
        messages, dropped = self.message_ends[n - 1] if n else 0, self.dropped_ends[n - 1] if n else 0
        return ReadItems(
            self.units[:n],
            self.first,
            self.messages[:messages],
            self.item_of[:messages],
            self.dropped[:dropped],
            self.chat[:messages],
            self.message_ends[:n],
            self.dropped_ends[:n],
            self.signed[:n],
        )

    @property
    def signatures(self) -> tuple[Signature, ...] | None:
        """The signatures of the newest unit that holds any."""
        last = self.signed[-1] if self.signed else -1
        return self.units[last].signatures if last >= 0 else None


EMPTY_READ = ReadItems((), 0, (), (), (), (), (), (), ())


class ChatTranslation:
    """One request's canonical messages, the native item each came from, and what the prompt leaves out: of the
    conversation (`dropped`) and of the request's other fields (`notes`, told after it)."""

    def __init__(self, signer: TurnSigner | None) -> None:
        self.signer = signer
        self.messages: list[dict[str, Any]] = []
        self.item_of: list[int] = []
        self.dropped: list[str] = []
        self.notes: list[str] = []
        self.signatures: list[Signature] = []  # those of the newest item that holds any
        self.units: list[ItemTranslation] = []  # each item's translation, where items translate on their own
        # A compaction the request asks the proxy to serve (what asked for it), and the replies whose summaries its
        # compaction items carry (see `compaction_items`).
        self.compacts: str | None = None
        self.compaction_refs: list[str] = []
        # Where the conversation starts over: the messages before the last compaction block are not the model's
        # context any more (Anthropic's server-side compaction drops them), the system prompt aside.
        self.cut_at: int | None = None
        # When the proxy is to compact instead of answering (Anthropic's compact_20260112): (prompt tokens, the
        # instruction).
        self.compact_when: tuple[int, str] | None = None
        # The known items' reading this translation began with (`ReadItems`), which its own reading extends.
        self.resumed: ReadItems | None = None

    def add(self, item: int, message: dict[str, Any]) -> dict[str, Any]:
        self.messages.append(message)
        self.item_of.append(item)
        return message

    def take(self, first: int, units: Sequence[ItemTranslation]) -> list[ChatMessage]:
        """Add the translations of consecutive items from item `first` (made now, or on an earlier turn: their
        messages validated then are returned)."""
        messages, item_of, dropped = self.messages, self.item_of, self.dropped
        known: list[ChatMessage] = []
        signatures = None
        for item, unit in enumerate(units, first):
            if unit.compaction is not None:
                self.cut_at = len(messages)
                self.compaction_refs.append(unit.compaction)
            messages += unit.messages
            item_of += [item] * len(unit.messages)
            dropped += unit.dropped
            if unit.signatures is not None:
                signatures = unit.signatures
            known += unit.chat
        if signatures is not None:
            self.signatures = list(signatures)
        self.units += units
        return known

    def resume(self, first: int, read: ReadItems) -> list[ChatMessage]:
        """Begin the conversation, from item `first`, with the known items' reading; their validated messages."""
        self.resumed = read
        self.messages += read.messages
        shift = first - read.first
        self.item_of += read.item_of if not shift else [item + shift for item in read.item_of]
        self.dropped += read.dropped
        if (signatures := read.signatures) is not None:
            self.signatures = list(signatures)
        self.units += read.units
        return list(read.chat)


def known_block(messages: list[Any], leading: int, known: list[ChatMessage]) -> list[ChatMessage | None]:
    """`found` for `with_known_chat` when the known messages follow the first `leading` ones."""
    return [*([None] * leading), *known, *([None] * (len(messages) - leading - len(known)))]


def passthrough_message(upstream: UpstreamPassthrough) -> str:
    """What the agent is told of a backend's refusal: its status and its own message, where it has one."""
    message = f"backend answered {upstream.status}"
    try:
        parsed = json.loads(upstream.body)
        detail = parsed.get("error", parsed) if isinstance(parsed, dict) else None
        if isinstance(detail, dict) and isinstance(detail.get("message"), str):
            message = f"{message}: {detail['message']}"
        elif isinstance(detail, str):
            message = f"{message}: {detail}"
    except ValueError:
        text = upstream.body[:500].decode("utf-8", "replace").strip()
        if text:
            message = f"{message}: {text}"
    return message


class TranslatedApi[T: ChatTranslation]:
    """An API translated to chat: served at `…/v1/<its path>` under any prefix (and `/sessions/{id}/`), its turns
    run on the backend's chat path under the same prefix; it signs with the proxy's signer, and remembers up to
    `memo_bytes` of the requests it read. An API fills in the attributes and the hooks below."""

    name: str
    signs = True  # mints values the agent echoes back (see turn_refs)
    path: re.Pattern[str]  # groups: sid, prefix, and `count` for a count_tokens route
    request_model: type[BoundedRequest]
    member = "messages"  # the request's array of native items, the conversation
    noun: str  # the request, in a refusal's words ("messages request")
    item_noun = "message"  # what the model reads, in the refusal of a request with none
    # Sampling fields the chat body takes as they are: each chat name with the request's (see `copy_sampling`).
    sampling: dict[str, str] = {}

    def __init__(self, signer: TurnSigner | None = None, memo_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.signer = signer
        # The requests read before, each with this API's reading of its items (`reading`).
        self.known_requests = KnownRequests(memo_bytes, member=self.member)

    @property
    def memos(self) -> tuple[KnownRequests, ...]:
        return (self.known_requests,)

    def resize_memos(self, budget_bytes: int) -> None:
        self.known_requests.resize(budget_bytes)

    def route(self, path: str) -> Route | None:
        match = self.path.match(path)
        if match is None:
            return None
        found = match.groupdict()
        action = "count_tokens" if found.get("count") else "compact" if found.get("compact") else "turn"
        return Route(self, action, match.group("sid"), match.group("prefix") + "/v1/chat/completions")  # type: ignore[arg-type]

    def parse(self, body: bytes, action: str = "turn", route: Route | None = None) -> AgentRequest:
        raw, style, extension = self.known_requests.read(body)
        request, appended, prior = self._validated(raw, extension)
        self.check(request, action)
        translation, items = self.begin(request, raw)
        offset, leading = len(items), len(translation.messages)
        native = raw[self.member]
        known: list[ChatMessage] = []
        if type(native) is list:  # (not where a string stands for the conversation: `begin` read it)
            items += native
            if prior is not None:
                known = self.resume(translation, prior, offset)
            for position, item in enumerate(appended, len(native) - len(appended)):
                self.translate_item(translation, offset + position, item, f"{self.member}.{position}")
        if action == "compact":
            self.serve_compaction(translation, len(items), COMPACT_ENDPOINT)
        self.close(translation)
        if translation.cut_at is not None:
            cut = translation.cut_at
            translation.messages[leading:cut] = []
            translation.item_of[leading:cut] = []
            known = known[cut - leading :]
        if not translation.messages:
            raise BadRequest(f"the request has no {self.item_noun} the model can read")
        chat_body: dict[str, Any] = {"model": self.model_name(request, route), "messages": translation.messages}
        extra = self.fill(request, translation, chat_body)
        chat_body.update(backend_extensions(raw))
        found = known_block(translation.messages, leading, known)
        chat = with_known_chat(chat_body, found, walked=True) or validated(
            ChatRequest, chat_body, self.noun, bounded=True
        )
        # A served compaction's reading holds the instruction the proxy added, and a cut one has lost messages: no
        # other request may take either.
        if style is not None and type(native) is list and translation.compacts is None and translation.cut_at is None:
            state, reading_of = self.reading(translation, chat.messages[leading:], leading, offset)
            self.known_requests.remember(body, raw, state, style, extension, reading_of)
        return AgentRequest(
            chat=chat,
            chat_body=chat_body,
            stream=self.streams(request, route),
            items=items,
            item_of=translation.item_of,
            thinking=self.thinking(request),
            previous_response_id=self.previous_reply(request),
            dropped=translation.dropped + translation.notes,
            extra=extra,
            compacts=translation.compacts,
            compaction_refs=translation.compaction_refs,
            compact_when=translation.compact_when,
        )

    def _validated(self, raw: dict[str, Any], extension: Extension | None) -> tuple[Any, list[Any], Any]:
        """The request validated, the items to translate, and the known items' reading to take (None: all of them
        are translated). Only the items after the known ones are validated, unless they are refused, when the whole
        request is, for the same words as always; or unless they cannot follow that reading (`continues`)."""
        native = raw.get(self.member)
        if extension is not None and isinstance(native, list):
            known = len(extension.known.raw_messages)
            shown = native[known:] or native[-1:]
            # Where the rest is the known request's own, only these messages' JSON bounds are walked.
            bounded = extension.only_appended_new and json_value_problem({self.member: shown}) is None
            try:
                request = validated(self.request_model, {**raw, self.member: shown}, "", bounded=bounded)
            except BadRequest:
                request = None
            if request is not None:
                appended = getattr(request, self.member) if len(native) > known else []
                if self.continues(extension.known.state, appended):
                    return request, appended, extension.known.state
        try:
            request = validated(self.request_model, raw, self.noun)
        except BadRequest as refused:
            raise self.refusal(raw, refused) from None
        whole = getattr(request, self.member)
        return request, whole if isinstance(whole, list) else [], None

    def copy_sampling(self, request: Any, chat_body: dict[str, Any]) -> None:
        for chat_name, name in self.sampling.items():
            value = getattr(request, name)
            if value is not None:
                chat_body[chat_name] = value

    def responder(self, request: AgentRequest, context: ReplyContext) -> TranslatedResponder:
        return self.responder_type(request, context)

    def error_status(self, error: TitoError) -> int:
        return error.status

    def error_body(self, error: TitoError) -> bytes:
        return self.error_json(self.error_status(error), error.message)

    # -- what an API fills in ------------------------------------------------------------------------------------

    responder_type: type[TranslatedResponder]

    @staticmethod
    def error_json(status: int, message: str) -> bytes:
        """An error in the API's own shape."""
        raise NotImplementedError

    def model_name(self, request: Any, route: Route | None) -> str | None:
        """The model the turn asks for (the body's, where the API's path does not name it)."""
        return request.model

    def streams(self, request: Any, route: Route | None) -> bool:
        """Whether the agent asked for a stream (the body's switch, where the API's path does not say)."""
        return bool(request.stream)

    def check(self, request: Any, action: str) -> None:
        """Refuse a request that lacks what `action` needs of it."""

    def begin(self, request: Any, raw: dict[str, Any]) -> tuple[T, list[dict[str, Any]]]:
        """A new translation holding the messages of the items before the conversation (a system prompt,
        instructions), and those items."""
        raise NotImplementedError

    def refusal(self, raw: dict[str, Any], refused: BadRequest) -> BadRequest:
        """What a refused request is told (a better-named reason than the validation's, where the API has one)."""
        return refused

    def continues(self, prior: Any, appended: list[Any]) -> bool:
        """Whether the appended items can follow the known items' reading (else all of them are translated)."""
        return True

    def translate_one(self, item: Any, where: str) -> ItemTranslation:
        """One native item's translation, where items translate on their own."""
        raise NotImplementedError

    def translate_item(self, translation: T, index: int, item: Any, where: str) -> None:
        translation.take(index, (self.translate_one(item, where),))

    def resume(self, translation: T, prior: Any, offset: int) -> list[ChatMessage]:
        """Take the known items' reading; their messages validated."""
        return translation.resume(offset, prior)

    def serve_compaction(self, translation: T, index: int, asked_by: str) -> None:
        """Ask the model for a summary of the conversation so far (`compaction_items`): the request is a compaction
        the proxy serves. A conversation with nothing but its system prompt has nothing to compact."""
        if not any(message["role"] != "system" for message in translation.messages):
            raise BadRequest(f"a compaction ({asked_by}) of a conversation that holds nothing to compact; nothing "
                             "was forwarded")  # fmt: skip
        translation.compacts = asked_by
        translation.add(index, {"role": "user", "content": SERVED_COMPACTION_PROMPT})

    def close(self, translation: T) -> None:
        """What depends on all the items (the newest signatures checked)."""

    def reading(
        self, translation: T, chat: list[ChatMessage], leading: int, offset: int
    ) -> tuple[Any, Callable[[int], Any] | None]:
        """What is remembered of reading the items (`chat`: their messages validated), and the reading of the first
        n of them where the API can give it (see `KnownRequests.remember`)."""
        state = ReadItems.of(translation, chat, leading, offset)
        return state, state.first_units

    def fill(self, request: Any, translation: T, chat_body: dict[str, Any]) -> dict[str, Any]:
        """The API's fields in the chat body (what the prompt leaves out of them noted); the reply's options."""
        raise NotImplementedError

    def thinking(self, request: Any) -> bool | None:
        """The agent's thinking switch, where the request has one."""
        return None

    def previous_reply(self, request: Any) -> str | None:
        """The stored reply the request continues, where the API names one."""
        return None


class HeldDeltas:
    """For a responder that shows none of the turn's text as it streams (a served compaction: the agent gets the sealed
    summary once the turn is done): every delta only opens the answer's one block or item (`started`)."""

    def started(self) -> bytes:
        raise NotImplementedError

    def reasoning_delta(self, reasoning: str) -> bytes:
        return self.started()

    def text_delta(self, text: str) -> bytes:
        return self.started()

    def call_delta(self, call: dict[str, Any]) -> bytes:
        return self.started()


class TranslatedResponder:
    """One turn's answer in a translated API: the stream is written from canonical chunks, each split here into its
    reasoning, text and tool-call deltas; a finished message is re-framed as the same stream (`reframed`)."""

    stream_headers = EVENT_STREAM_HEADERS

    def __init__(self, request: AgentRequest, context: ReplyContext) -> None:
        self.request = request
        self.context = context
        self.reply_id = context.reply_id
        self.open: tuple[str, int] | None = None  # the block or item being streamed: its kind and position
        self.pending_text = ""  # leading whitespace, held until text follows (a blank text is never shown)

    def reframed(self, outcome: TurnOutcome) -> bytes:
        """The finished turn as the stream a live one writes."""
        chunks = chunks_from_message({}, outcome.message, outcome.finish_reason)
        return self.stream_start() + b"".join(self.stream_chunk(c) for c in chunks) + self.stream_end(outcome, [])

    def stream_chunk(self, chunk: dict[str, Any]) -> bytes:
        out = b""
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                out += self.reasoning_delta(reasoning)
            text = delta.get("content")
            if isinstance(text, str) and text:
                out += self.text_delta(text)
            for call in delta.get("tool_calls") or []:
                out += self.call_delta(call)
        return out

    def stream_start(self) -> bytes:
        raise NotImplementedError

    def stream_end(self, outcome: TurnOutcome, tail: list[dict[str, Any]]) -> bytes:
        raise NotImplementedError

    def reasoning_delta(self, reasoning: str) -> bytes:
        raise NotImplementedError

    def text_delta(self, text: str) -> bytes:
        raise NotImplementedError

    def call_delta(self, call: dict[str, Any]) -> bytes:
        raise NotImplementedError

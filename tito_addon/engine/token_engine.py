"""The token engine: exact prompt ids for a turn, without re-tokenizing history.

Turn 1 is rendered from scratch. A later turn's prompt is the stored ids of the turn it extends (prompt +
completion, never re-tokenized), then the end-of-turn tail the model did not emit, then the tokens of only
the newly appended messages and the generation prompt, both rendered in a small synthetic context. The
cost of a continuation therefore depends on the appended messages, not on the history length.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
import orjson
import tokenizers

from tito_addon.canonical_chat import ChatMessage
from tito_addon.engine.model_families import ModelFamily, suggest_family
from tito_addon.engine.role_pieces import RolePieces
from tito_addon.engine.template_messages import template_message
from tito_addon.engine.tokenizer_loading import generation_eos_ids, rust_fast_path, text_encoder, tokenizer_sha256
from tito_addon.engine.vision_tokens import ImagePads, PlacedImage, VisionScheme
from tito_addon.tito_errors import BadRequest, TemplateRefusal, TokenizationError

logger = logging.getLogger(__name__)

APPENDABLE_ROLES = ("tool", "user", "system")
# Keys a request may not pass as template kwargs: they would replace the template or the render itself.
FORBIDDEN_KWARGS = frozenset(
    {"chat_template", "messages", "tools", "documents", "add_generation_prompt", "tokenize", "continue_final_message"}
)
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_lookup",
        "description": "Look a value up.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}
_MARK = "TITO_PROBE_ASSISTANT_TEXT"
CACHE_ENTRIES = 4096


@dataclass(frozen=True)
class Segment:
    """A half-open span of prompt ids and where it came from."""

    source: str  # render | boundary | messages | generation_prompt
    start: int
    end: int


@dataclass(frozen=True)
class PromptPiece:
    """Prompt ids a turn adds after its parent's prompt + completion (all of them for a first turn)."""

    ids: list[int]
    segments: list[Segment]
    # The images of the messages it renders, each with the run of pad ids it became (offsets into `ids`).
    images: list[PlacedImage] = field(default_factory=list)


class TokenEngine:
    """Builds prompt ids for first turns and continuations, for one tokenizer and family."""

    def __init__(
        self,
        tokenizer: Any,
        family: ModelFamily,
        *,
        append_roles: Sequence[str] = APPENDABLE_ROLES,
        pinned_kwargs: dict[str, Any] | None = None,
        tokenizer_name: str = "",
        vision: VisionScheme | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self._fast: tokenizers.Tokenizer | None = None
        self._small_cache: dict[str, list[int]] = {}
        self._render_cache: dict[bytes, str] = {}
        self._history_cache: dict[bytes, bool] = {}
        self.family = family
        self.append_roles = tuple(append_roles)
        self.pinned_kwargs = {**family.pinned_kwargs, **(pinned_kwargs or {})}
        self.tokenizer_name = tokenizer_name or str(getattr(tokenizer, "name_or_path", ""))
        own_template = getattr(tokenizer, "chat_template", None)
        self.template: str = family.chat_template() or own_template or ""
        if not self.template:
            raise TokenizationError(f"tokenizer {self.tokenizer_name!r} has no chat template")
        for role in self.append_roles:
            if role not in APPENDABLE_ROLES:
                raise ValueError(f"unknown append role {role!r}; choose from {', '.join(APPENDABLE_ROLES)}")
            if role in family.refused_append_roles:
                raise ValueError(
                    f"family {family.name} cannot append {role} messages to a stored turn: "
                    f"{family.refused_append_roles[role]}"
                )
        bad = FORBIDDEN_KWARGS & set(self.pinned_kwargs)
        if bad:
            raise ValueError(f"chat template kwargs may not set {', '.join(sorted(bad))}")
        self._fast = rust_fast_path(tokenizer, self.template)
        self.encode = text_encoder(tokenizer, self._fast)
        if family.single_token_newline and len(self.encode("\n")) != 1:
            raise ValueError(f"family {family.name} needs a tokenizer that encodes '\\n' as one token")
        self.stop_ids = self._stop_ids()
        self.stop_texts = {i: str(self.tokenizer.convert_ids_to_tokens(i)) for i in self.stop_ids}
        # Every token the tokenizer adds to its vocabulary (markers such as <think> or <tool_call> are added tokens
        # even where they are not flagged special): what a server's parsers may look for in a prompt.
        self.special_ids = frozenset(tokenizer.added_tokens_decoder) | frozenset(tokenizer.all_special_ids)
        self.end_of_turn_ids = self._end_of_turn_ids()
        self.unterminated_ids = (
            self.encode(family.unterminated_close) if family.unterminated_close else list(self.end_of_turn_ids)
        )
        self.end_of_turn_tails = self._end_of_turn_tails()
        end_id = tokenizer.convert_tokens_to_ids(family.reasoning_end) if family.reasoning_end else None
        self.reasoning_end_id = end_id if tokenizer.convert_ids_to_tokens(end_id or 0) == family.reasoning_end else None
        self._tool_name_pattern = re.compile(family.tool_call_name_pattern) if family.tool_call_name_pattern else None
        self.template_sha256 = hashlib.sha256(self.template.encode()).hexdigest()
        self.tokenizer_sha256 = tokenizer_sha256(tokenizer)
        self.images = ImagePads(
            vision or family.vision, tokenizer, family=family.name, tokenizer_name=self.tokenizer_name
        )
        self.pieces = RolePieces(
            self._synthetic_suffix_jinja, family=family.name, template=self.template, tokenizer=tokenizer
        )

    # -- primitives -------------------------------------------------------------------------------

    def _encode_small(self, text: str) -> list[int]:
        """For the few short texts every turn repeats (the generation prompt): encoded once."""
        ids = self._small_cache.get(text)
        if ids is None:
            if len(self._small_cache) >= CACHE_ENTRIES:
                self._small_cache.clear()
            ids = self._small_cache[text] = self.encode(text)
        return list(ids)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
    ) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                chat_template=self.template,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise TemplateRefusal(
                f"the model's chat template refused this request: {exc}; nothing was forwarded"
            ) from exc
        except Exception as exc:  # jinja raises many types, all of which mean "this input cannot be rendered"
            raise TokenizationError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(text, str):
            raise TokenizationError("chat template did not render text")
        return text

    def effective_kwargs(
        self, request_kwargs: dict[str, Any] | None, *, thinking: bool | None = None
    ) -> dict[str, Any]:
        """Pinned kwargs overlaid by the request's own: these build the ids and go to the backend. An agent API's
        thinking switch (Anthropic `thinking`) sets the family's kwarg under both: an operator's pin wins over it."""
        request_kwargs = request_kwargs or {}
        bad = FORBIDDEN_KWARGS & set(request_kwargs)
        if bad:
            raise BadRequest(f"chat_template_kwargs may not set {', '.join(sorted(bad))}")
        if thinking is None:
            return {**self.pinned_kwargs, **request_kwargs}
        return {**self.family.thinking_kwargs(thinking), **self.pinned_kwargs, **request_kwargs}

    # -- turns ------------------------------------------------------------------------------------

    def first_turn(
        self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
    ) -> PromptPiece:
        text = self.render([template_message(m) for m in messages], tools, add_generation_prompt=True, kwargs=kwargs)
        ids, images = self.images.expanded(self.encode(text), messages)
        return PromptPiece(ids=ids, segments=[Segment("render", 0, len(ids))], images=images)

    def continuation(
        self,
        parent_completion_ids: Sequence[int],
        appended: list[ChatMessage],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
    ) -> PromptPiece:
        """Ids that follow a stored turn: its end-of-turn tail, the appended messages, the generation prompt."""
        for message in appended:
            if message.role not in self.append_roles:
                raise BadRequest(
                    f"role {message.role!r} cannot be appended to a stored turn (allowed: "
                    f"{', '.join(self.append_roles)}; to allow more roles set tito_append_roles)"
                )
        boundary = self.boundary_ids(parent_completion_ids)
        messages_text, generation_text = self._synthetic_suffix(
            appended, tools, kwargs, self.called_tool_names(parent_completion_ids)
        )
        body = self.encode(messages_text + generation_text)
        generation_ids = self._encode_small(generation_text)
        split = len(body) - len(generation_ids)
        if generation_ids and body[split:] != generation_ids:
            split = len(body)  # the two merged across the edge: report them as one span
        # Pads sit in the messages' span only: expanding them moves where the generation prompt starts.
        body, images = self.images.expanded(body, appended)
        split += sum(image.length - 1 for image in images)
        images = [image.shifted(len(boundary)) for image in images]
        ids = boundary + body
        segments = []
        start = 0
        for source, length in (
            ("boundary", len(boundary)),
            ("messages", split),
            ("generation_prompt", len(body) - split),
        ):
            if length:
                segments.append(Segment(source, start, start + length))
                start += length
        return PromptPiece(ids=ids, segments=segments, images=images)

    def boundary_ids(self, completion_ids: Sequence[int]) -> list[int]:
        """The end-of-turn tail the template writes after an assistant turn but the model did not emit.

        A completion that stopped on the first id(s) of a tail (Qwen: `<|im_end|>` without its `\\n`; gpt-oss:
        `<|return|>` after a final answer, `<|call|>` after a tool call) gets the rest of that tail. One that did
        not close its turn (cut off by max_tokens, or a stop string) gets the family's close (the template's tail
        after assistant text, or gpt-oss's `<|end|>`), so the next message never glues onto an unterminated turn.
        """
        best_k, best_tail = 0, self.unterminated_ids
        for tail in self.end_of_turn_tails:
            for k in range(min(len(tail), len(completion_ids)), best_k, -1):
                if list(completion_ids[-k:]) == tail[:k]:
                    best_k, best_tail = k, tail
                    break
        return list(best_tail[best_k:])

    def called_tool_names(self, completion_ids: Sequence[int]) -> list[str]:
        """Names of the tools a completion called, in order, where the family's template needs them."""
        if self._tool_name_pattern is None or not completion_ids:
            return []
        text = self.tokenizer.decode(list(completion_ids), skip_special_tokens=False)
        return self._tool_name_pattern.findall(text)

    def _synthetic_suffix(
        self,
        appended: list[ChatMessage],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
        called_names: Sequence[str] = (),
    ) -> tuple[str, str]:
        """The appended messages' text and the generation prompt: from the template's pieces where they hold."""
        fast = self.pieces.suffix(appended, tools, kwargs, called_names)
        return fast if fast is not None else self._synthetic_suffix_jinja(appended, tools, kwargs, called_names)

    def _synthetic_suffix_jinja(
        self,
        appended: list[ChatMessage],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
        called_names: Sequence[str] = (),
    ) -> tuple[str, str]:
        base = self._synthetic_base(appended, called_names)
        extended = base + [template_message(m) for m in appended]
        before = self._render_base(base, tools, kwargs)
        without_prompt = self.render(extended, tools, add_generation_prompt=False, kwargs=kwargs)
        with_prompt = self.render(extended, tools, add_generation_prompt=True, kwargs=kwargs)
        if not without_prompt.startswith(before) or not with_prompt.startswith(without_prompt):
            raise TokenizationError(
                "the chat template is not append-only for these messages (rendering them changed earlier text); "
                f"family {self.family.name!r} cannot extend this conversation"
            )
        return without_prompt[len(before) :], with_prompt[len(without_prompt) :]

    def _render_base(
        self, base: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
    ) -> str:
        """The synthetic base repeats across turns (it depends on the tools, kwargs and called ids only)."""
        try:
            key = orjson.dumps([base, tools, kwargs], option=orjson.OPT_SORT_KEYS)
        except TypeError:  # e.g. an integer beyond 64 bits in a tool schema: just render
            return self.render(base, tools, add_generation_prompt=False, kwargs=kwargs)
        text = self._render_cache.get(key)
        if text is None:
            if len(self._render_cache) >= CACHE_ENTRIES:
                self._render_cache.clear()
            text = self._render_cache[key] = self.render(base, tools, add_generation_prompt=False, kwargs=kwargs)
        return text

    def history_changed(
        self, stored: dict[str, Any], requested: dict[str, Any], tools: list[dict[str, Any]] | None
    ) -> bool:
        """Whether a stored turn built with `stored` kwargs renders its history differently under `requested`
        ones. Kwargs that shape only the generation prompt (Qwen3 `enable_thinking`) do not; ones that shape the
        system message or earlier turns (gpt-oss `reasoning_effort`, `current_date`) do."""
        if stored == requested:
            return False
        try:
            key = orjson.dumps([stored, requested, tools], option=orjson.OPT_SORT_KEYS)
        except TypeError:
            key = None
        if key is not None and key in self._history_cache:
            return self._history_cache[key]
        history = [*self._synthetic_base([]), {"role": "user", "content": "And now?"}]
        history[2] = {"role": "assistant", "content": "OK.", "reasoning_content": "Think."}
        try:
            changed = self.render(history, tools, add_generation_prompt=False, kwargs=stored) != self.render(
                history, tools, add_generation_prompt=False, kwargs=requested
            )
        except TokenizationError:
            changed = True  # cannot tell: a fresh render is always exact
        if key is not None:
            if len(self._history_cache) >= CACHE_ENTRIES:
                self._history_cache.clear()
            self._history_cache[key] = changed
        return changed

    @staticmethod
    def _synthetic_base(appended: list[ChatMessage], called_names: Sequence[str] = ()) -> list[dict[str, Any]]:
        """A stand-in history ending in an assistant turn whose tool calls pair with the appended results.

        `called_names`: the tools the stored completion really called, for templates that name them in a result.
        """
        calls = []
        for index, message in enumerate(appended):
            if message.role != "tool":
                break
            if called_names:
                name = called_names[min(index, len(called_names) - 1)]
            else:
                name = message.name or "tool"
            calls.append(
                {
                    "id": message.tool_call_id or f"call_{index}",
                    "type": "function",
                    "function": {"name": name, "arguments": {}},
                }
            )
        assistant: dict[str, Any] = {"role": "assistant", "content": "" if calls else "OK."}
        if calls:
            assistant["tool_calls"] = calls
        return [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello."},
            assistant,
        ]

    # -- startup checks ---------------------------------------------------------------------------

    def _stop_ids(self) -> list[int]:
        ids = set(generation_eos_ids(self.tokenizer_name))
        if isinstance(self.tokenizer.eos_token_id, int):
            ids.add(self.tokenizer.eos_token_id)
        # A hub name has no local generation_config.json: the family's own stop tokens still count.
        for token in self.family.stop_tokens:
            token_id = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id != self.tokenizer.unk_token_id:
                ids.add(token_id)
        return sorted(ids)

    def _end_of_turn_ids(self) -> list[int]:
        messages = [
            {"role": "system", "content": "You are a probe."},
            {"role": "user", "content": "Say the mark."},
            {"role": "assistant", "content": _MARK},
        ]
        text = self.render(messages, None, add_generation_prompt=False, kwargs=self.pinned_kwargs)
        at = text.rfind(_MARK)
        if at < 0:
            raise ValueError("the chat template does not render assistant content; cannot find the end of a turn")
        tail = self.encode(text[at + len(_MARK) :])
        if not tail:
            raise ValueError("the chat template writes nothing after an assistant turn; cannot find its end")
        return tail

    def _end_of_turn_tails(self) -> list[list[int]]:
        """Every way the template ends an assistant turn, each from the stop id the model emits there.

        Besides the tail after assistant text: the tail after a tool-call turn (gpt-oss ends it with `<|call|>`
        where a final answer ends with `<|return|>`), and the family's close for a cut-off message, which
        a completion may also have emitted itself.
        """
        tails = [list(self.end_of_turn_ids)]
        history = [
            {"role": "system", "content": "You are a probe."},
            {"role": "user", "content": "Look up alpha."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "callProbe",
                        "type": "function",
                        "function": {"name": "probe_lookup", "arguments": {"key": "alpha"}},
                    }
                ],
            },
        ]
        try:
            text = self.render(history, [PROBE_TOOL], add_generation_prompt=False, kwargs=self.pinned_kwargs)
            ids = self.encode(text)
        except TokenizationError:
            ids = []  # a template without tool calls; the probe reports it if tool appends are configured
        stops = set(self.stop_ids)
        at = max((i for i, token in enumerate(ids) if token in stops), default=-1)
        if at >= 0 and ids[at:] not in tails:
            tails.append(ids[at:])
        if self.unterminated_ids not in tails:
            tails.append(list(self.unterminated_ids))
        return tails

    def append_only_problems(self) -> list[str]:
        """Probe each configured role: is `render(history + appended)` an extension of `render(history)`,
        and does the synthetic context produce exactly the appended text? Empty list: append-only.

        Two histories: one ending in a tool call, one ending in a final answer; both carry reasoning, since
        templates that drop earlier reasoning (or rewrite a final answer's stop token) do it once a turn is
        no longer the last."""
        tool_turn = [
            ChatMessage(role="system", content="You are a probe."),
            ChatMessage(role="user", content="Look up alpha."),
            ChatMessage(
                role="assistant",
                content="",
                reasoning_content="I should look it up.",
                tool_calls=[{"id": "callProbe", "function": {"name": "probe_lookup", "arguments": '{"key": "alpha"}'}}],
            ),
        ]
        answer_turn = tool_turn[:2] + [
            ChatMessage(role="assistant", content="alpha is 1.", reasoning_content="I know this one.")
        ]
        appended_by_role = {
            # No `name`: the OpenAI wire format does not carry one on tool messages.
            "tool": ChatMessage(role="tool", content="alpha=1", tool_call_id="callProbe"),
            "user": ChatMessage(role="user", content="And beta?"),
            "system": ChatMessage(role="system", content="Be brief."),
        }
        problems = []
        for role in self.append_roles:
            histories = [("a tool call", tool_turn)] + ([("a final answer", answer_turn)] if role != "tool" else [])
            for label, history in histories:
                problem = self._append_problem(history, appended_by_role[role])
                if problem:
                    problems.append(f"appending a {role} message after {label}{problem}")
        return problems

    def _append_problem(self, history: list[ChatMessage], message: ChatMessage) -> str | None:
        tools = [PROBE_TOOL]
        rendered = [template_message(m) for m in history]
        try:
            before = self.render(rendered, tools, add_generation_prompt=False, kwargs=self.pinned_kwargs)
            prompt = self.render(rendered[:-1], tools, add_generation_prompt=True, kwargs=self.pinned_kwargs)
        except TokenizationError as exc:
            return f": {exc.message}"
        try:
            full = self.render(
                rendered + [template_message(message)], tools, add_generation_prompt=True, kwargs=self.pinned_kwargs
            )
        except TokenizationError as exc:
            if message.role != "tool" and rendered[-1].get("tool_calls"):
                return None  # the template forbids a tool call left unanswered (Mistral): no request can do this
            return f": {exc.message}"
        if not full.startswith(before):
            pairs = enumerate(zip(before, full, strict=False))
            at = next((i for i, (a, b) in pairs if a != b), min(len(before), len(full)))
            return f" rewrites earlier text at character {at}: {before[at : at + 40]!r} becomes {full[at : at + 40]!r}"
        completion = self.encode(before[len(prompt) :]) if before.startswith(prompt) else []
        try:
            messages_text, generation_text = self._synthetic_suffix(
                [message], tools, self.pinned_kwargs, self.called_tool_names(completion)
            )
        except (TokenizationError, BadRequest) as exc:
            return f": {exc.message}"
        if full[len(before) :] != messages_text + generation_text:
            return (
                f" renders differently in a synthetic context: {full[len(before) :][:60]!r} in the real history, "
                f"{(messages_text + generation_text)[:60]!r} in the synthetic one"
            )
        return None

    def check_append_only(self) -> None:
        problems = self.append_only_problems()
        if problems:
            hint = suggest_family(self.template)
            advice = f"; use tito_model_family={hint}" if hint and hint != self.family.name else ""
            raise ValueError(
                f"the chat template of {self.tokenizer_name!r} (family {self.family.name}) is not append-only: "
                + "; ".join(problems)
                + advice
            )

"""The on-disk record format: one JSON object per line, one file per session.

A turn line stores only the prompt ids added since its parent turn (`prompt_added_ids`) plus the full
prompt length, so a session's file grows linearly with its tokens; the full prompt of any turn is the
parent chain's added ids and completions, concatenated (see `record_reader`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from tito_addon.exact_json import dumps_exact

TURN_SCHEMA = "tito.turn.v1"
CLOSE_SCHEMA = "tito.session_close.v1"
WITHDRAWN_SCHEMA = "tito.turn_withdrawn.v1"
ANNOTATION_SCHEMA = "tito.annotation.v1"

# An annotation is a trainer's note, not a trajectory: bounded so that no client can grow a session file without
# limit through it (the control API answers 413 beyond these).
MAX_LABELS = 64
MAX_LABEL_CHARS = 256
MAX_METADATA_BYTES = 64 * 1024
MAX_GROUP_CHARS = 256


class TokenizerInfo(BaseModel):
    name: str
    tokenizer_sha256: str
    template_sha256: str
    family: str


class SegmentSpan(BaseModel):
    source: str
    start: int
    end: int


class CompletionBudget(BaseModel):
    """A completion budget cut to what the backend's context leaves after the prompt."""

    model_config = ConfigDict(extra="forbid")

    asked: int  # the agent's max_tokens (or max_completion_tokens)
    sent: int  # what the backend got: the context length less the prompt, less one
    context_length: int


CALLS = ("main", "compaction", "subagent", "side")
Call = Literal["main", "compaction", "subagent", "side"]


class Follows(BaseModel):
    """The turn a segment continues, named on the segment's first turn: for a context rebuilt after a compaction, the
    summary turn; for a sub-agent, the parent turn whose tool call spawned it (and that call's id)."""

    model_config = ConfigDict(extra="forbid")

    session: str
    turn_id: int
    tool_call_id: str | None = None
    # How the link was found: the summary's text inside the new context (`summary`), a tool call's argument as the
    # sub-agent's first message (`tool_argument`), or a compaction item this proxy minted (`compaction_item`).
    how: Literal["summary", "tool_argument", "compaction_item"]


class Resumption(BaseModel):
    """A generation the backend aborted (a weight update), or whose stream an engine's death cut, and the proxy resumed
    from its exact ids until it ended."""

    model_config = ConfigDict(extra="forbid")

    attempts: int = Field(ge=2)  # engine requests the generation took
    cuts: list[int]  # where each aborted attempt ended, as a count of the turn's completion tokens


ROUTES_SUFFIX = ".routes"
# A side file's name as the recorder makes it (`trajectory_recorder.routes_file_name`): never a path, never `..`.
_ROUTES_FILE = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,250}\.routes$"


class RoutedExperts(BaseModel):
    """A turn's mixture-of-experts routes (asked with `tito_routed_experts`): the rows of its sequence's positions
    `[start, start + rows)` (positions count its prompt, then its completion), kept in `file`, a side file of its
    session in the record dir, from byte `offset`: a C-ordered `(rows, layers, topk)` array of `dtype`, no header.
    The positions before `start` are its parent's (`records/expert_routes_reader` stitches them). `attempts`: a
    generation resumed across an abort, where each later attempt's rows begin. `missing`: why the rows end before the
    turn's last position but one (its last sampled token has no route of its own), e.g. a backend that streamed none."""

    model_config = ConfigDict(extra="forbid")

    start: int = Field(ge=0)
    rows: int = Field(ge=0)
    layers: int | None = Field(default=None, ge=1)
    topk: int | None = Field(default=None, ge=1)
    dtype: Literal["uint8", "uint16", "int32"] | None = None
    file: Annotated[str, StringConstraints(pattern=_ROUTES_FILE)] | None = None
    offset: int | None = Field(default=None, ge=0)
    attempts: list[int] | None = None
    missing: str | None = None

    @model_validator(mode="after")
    def _shaped(self) -> RoutedExperts:
        if self.file is not None and ".." in self.file:
            raise ValueError("a routes file is a name in the record dir, never a path")
        if self.rows and None in (self.layers, self.topk, self.dtype):
            raise ValueError("routes with rows need their layers, topk and dtype")
        return self

    @property
    def end(self) -> int:
        return self.start + self.rows

    @property
    def nbytes(self) -> int:
        width = {"uint8": 1, "uint16": 2, "int32": 4}[self.dtype] if self.dtype else 0
        return self.rows * (self.layers or 0) * (self.topk or 0) * width


class RecordedImage(BaseModel):
    """An image a turn's prompt added: the file in the record dir's image store (`images/<sha256>.<format>`), the size
    it was displayed at, and the run of pad ids it became in the session's sequence (from its first id)."""

    model_config = ConfigDict(extra="forbid")

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    format: Literal["png", "jpeg", "gif", "webp"]
    width: int = Field(ge=1)
    height: int = Field(ge=1)
    offset: int = Field(ge=0)
    length: int = Field(ge=1)


class Failover(BaseModel):
    """Backend calls of a turn that a dead engine broke and the proxy sent again (`engine_failover`)."""

    model_config = ConfigDict(extra="forbid")

    retries: int = Field(ge=1)  # calls sent again, over the whole turn
    errors: list[str]  # what broke them (the last 8)


class TurnRecord(BaseModel):
    """One committed turn."""

    model_config = ConfigDict(extra="forbid")

    schema_: Literal["tito.turn.v1"] = Field(default=TURN_SCHEMA, alias="schema")
    session_id: str
    turn_id: int
    parent_turn_id: int | None
    ts: float
    model: str | None
    backend_kind: str
    request_id: str | None = None
    sampling: dict[str, Any]
    chat_template_kwargs: dict[str, Any]
    # Tools are written when they differ from the parent turn's (hash on every line).
    tools_sha256: str | None
    tools: list[dict[str, Any]] | None = None
    # Messages the request added after the parent turn's history (the whole request for a first turn), or, when
    # recorded without message text (`tito_record_message_text=false`), only their keys as hex digests: enough
    # to resume and replay the session, not to audit it.
    appended_messages: list[dict[str, Any]] | None = None
    appended_keys: list[str] | None = None
    prompt_added_ids: list[int]
    prompt_segments: list[SegmentSpan]
    prompt_len: int
    completion_ids: list[int]
    completion_logprobs: list[float]
    assistant_message: dict[str, Any]
    finish_reason: str | None
    # How many of `completion_ids` were reasoning (up to and with the family's end-of-thinking token), when any:
    # replay has no tokenizer to count them, and the reply's usage says them (Gemini's `thoughtsTokenCount`,
    # Responses' `reasoning_tokens`). Null on lines written before it was recorded.
    reasoning_tokens: int | None = None
    ambiguous_parent: bool = False
    # The agent API the turn came in (chat, anthropic_messages, openai_responses, gemini), the id its reply carried,
    # the appended items in that API's own form (the canonical ones are `appended_messages`), and what the prompt
    # left out of the request (server tools, unreadable reasoning).
    api: str = "chat"
    reply_id: str | None = None
    appended_items: list[dict[str, Any]] | None = None
    left_out: list[str] | None = None
    # vLLM: does the server's own from-scratch render equal our ids? {equal, first_divergence}; null on sglang.
    render_skew: dict[str, Any] | None = None
    backend_version: str | None = None
    # The weights that sampled the turn, as the backend reported them: sglang's `meta_info.weight_version`, vLLM's
    # (0.32+) last `weight_versions` span; null when it reports none (sglang's chat streams never do).
    weight_version: str | None = None
    # Only when the weights changed during the turn: [{version, start, end}] over `completion_ids` (a version the
    # backend did not report is null).
    weight_version_spans: list[dict[str, Any]] | None = None
    # Only when the backend aborted the generation and the proxy resumed it: how many engine requests it took and
    # where each cut fell (the ids, log-probs and spans above are the whole generation's).
    resumed: Resumption | None = None
    # Only when the weights that sampled this turn (`weight_version`) are not those of its parent turn, both reported:
    # the parent's version. An engine of other weights took the session over, or the weights changed between turns.
    parent_weight_version: str | None = None
    # The engine that served the turn, where the proxy chose it (`tito_engines`, a fixed list; a router does not say),
    # and, only when backend calls of the turn broke and were sent again, how many and why.
    engine: str | None = None
    failover: Failover | None = None
    # Only when the agent asked for more completion tokens than the backend's context leaves after the prompt: what
    # it asked, what was sent instead, and the context length the server reported.
    completion_budget: CompletionBudget | None = None
    # Only when the backend served the turn under another model name than the agent's (`model`): vLLM answers only to
    # the names it serves, and an agent's side calls use their own small-model aliases.
    served_model: str | None = None
    # Only with `tito_routed_experts`: its MoE routes (where they are kept, which positions, what is missing), and how
    # many of its sequence's first positions its record chain holds routes for (all but its last: complete).
    routed_experts: RoutedExperts | None = None
    routed_experts_through: int | None = None
    # Only where its prompt added images: each image's file in the image store and its run of pad ids.
    images: list[RecordedImage] | None = None
    # The episode the turn belongs to (a named session's name; in an automatic session, `SESSION/ROOT_TURN` of the
    # rollout's first turn), what kind of call it is, and on a segment's first turn that continues another, which
    # turn that is. `call_reason`: why the rules placed it so, where a rule rather than its parent decided. Lines
    # written before episodes existed lack them: readers take the session as the episode and every call as `main`.
    episode: str | None = None
    call: Call = "main"
    follows: Follows | None = None
    call_reason: str | None = None
    tokenizer: TokenizerInfo

    def token_weight_versions(self) -> list[str | None]:
        """The weight version that sampled each completion token: the spans where the weights changed during the turn,
        else the turn's one version (null where the backend reported none)."""
        if self.weight_version_spans:
            versions: list[str | None] = [None] * len(self.completion_ids)
            for span in self.weight_version_spans:
                versions[span["start"] : span["end"]] = [span["version"]] * (span["end"] - span["start"])
            return versions
        return [self.weight_version] * len(self.completion_ids)

    @property
    def episode_id(self) -> str:
        return self.episode if self.episode is not None else self.session_id

    @model_validator(mode="after")
    def _messages_or_keys(self) -> TurnRecord:
        if (self.appended_messages is None) == (self.appended_keys is None):
            raise ValueError("a turn records either appended_messages or appended_keys")
        return self

    def line_fields(self) -> dict[str, Any]:
        """What the line holds, as plain JSON values (also the flow metadata of a `-w` capture)."""
        return without_defaults(self.model_dump(by_alias=True))

    def dump_line(self) -> bytes:
        return dump_line(self.line_fields())


def dump_line(fields: dict[str, Any]) -> bytes:
    """One record line's JSON, without its newline. ValueError for a NaN or an Infinity: one must never reach a
    trainer disguised as JSON (orjson alone would write it as `null`)."""
    return dumps_exact(fields, allow_nan=False)


def without_defaults(line: dict[str, Any]) -> dict[str, Any]:
    """`line` (a turn's fields by alias) without the optional fields that hold their default."""
    for name, default in OMITTED_AT_DEFAULT.items():
        if line[name] is default:
            del line[name]
    return line


# Optional fields left off a line while they hold their default (reading restores it): ~100 bytes a turn.
OMITTED_AT_DEFAULT: dict[str, Any] = {
    "request_id": None, "tools": None, "appended_messages": None, "appended_keys": None, "ambiguous_parent": False,
    "render_skew": None, "backend_version": None, "api": "chat", "reply_id": None, "appended_items": None,
    "left_out": None, "weight_version": None, "weight_version_spans": None, "completion_budget": None,
    "served_model": None, "follows": None, "call_reason": None, "reasoning_tokens": None, "resumed": None,
    "routed_experts": None, "routed_experts_through": None, "images": None,
    "parent_weight_version": None, "engine": None, "failover": None,
}  # fmt: skip


class SessionCloseRecord(BaseModel):
    """The last line of a session file: why it was closed."""

    schema_: Literal["tito.session_close.v1"] = Field(default=CLOSE_SCHEMA, alias="schema")
    session_id: str
    turns: int
    # closed: by a rollout driver through the control API (the name then stays closed, see `tito_after_close`)
    reason: Literal["idle", "evicted", "shutdown", "closed"]
    ts: float


class TurnWithdrawnRecord(BaseModel):
    """A turn written to disk whose commit to the shared session store then failed: the agent got an error, not this
    turn, so readers leave it out (its id is never reused)."""

    schema_: Literal["tito.turn_withdrawn.v1"] = Field(default=WITHDRAWN_SCHEMA, alias="schema")
    session_id: str
    turn_id: int
    reason: str
    ts: float


class AnnotationRecord(BaseModel):
    """A reward, labels or metadata a rollout driver attached to a session (`turn_id` null) or to one of its turns.

    Its own line in the session file, after the turns it describes (often after the close line: an episode is
    scored once it has ended). Readers that rebuild trajectories (resume, replay, re-drive) leave it out; export
    carries it into the rows of the segments it applies to (see `records/episode_segments`)."""

    model_config = ConfigDict(extra="forbid")

    schema_: Literal["tito.annotation.v1"] = Field(default=ANNOTATION_SCHEMA, alias="schema")
    session_id: str
    turn_id: int | None = None
    reward: float | None = Field(default=None, allow_inf_nan=False)
    labels: list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_LABEL_CHARS)]] | None = Field(
        default=None, max_length=MAX_LABELS
    )
    metadata: dict[str, Any] | None = None
    # The GRPO group the episode is a sample of (the task a driver gave it), what verl's `uid` and slime's
    # `group_index` come from (`records/rollout_groups`); without one an episode is grouped by its first prompt.
    group: Annotated[str, StringConstraints(min_length=1, max_length=MAX_GROUP_CHARS)] | None = None
    # An annotation on a turn reaches every segment of the turn's episode (`records/episode_segments`); `segment`:
    # only the segment the turn is in. None: the episode.
    scope: Literal["episode", "segment"] | None = None
    ts: float

    @model_validator(mode="after")
    def _says_something(self) -> AnnotationRecord:
        if self.reward is None and self.labels is None and self.metadata is None and self.group is None:
            raise ValueError("an annotation carries a reward, labels, metadata or a group")
        if self.group is not None and self.scope == "segment":
            raise ValueError("a group is its episode's: it cannot be scoped to a segment")
        if self.metadata is not None:
            size = len(json.dumps(self.metadata, ensure_ascii=False, allow_nan=False).encode())
            if size > MAX_METADATA_BYTES:
                raise ValueError(f"metadata is {size} bytes as JSON; at most {MAX_METADATA_BYTES}")
        return self

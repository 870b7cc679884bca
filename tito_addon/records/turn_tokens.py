"""One recorded turn as tokens: what the mitmproxy content view and the record browser show of it.

A turn's tokens are the part of its prompt it added (`prompt_added_ids`; the rest is its parent's prompt and
completion) and its completion, each token with its id, its text where a tokenizer names it, whether it is a special
token, and for a sampled token its log-prob and the weights that sampled it. Both views are built from this one shape:
the content view prints it (`turn_text`), the browser draws it (as JSON), so the two never disagree on a token.

Decoding is duck-typed on a transformers tokenizer (`batch_decode`, `all_special_ids`) and optional: without one the
ids and their facts are shown alone. A token is decoded on its own, so a character split across tokens shows as the
replacement character in each: what the model sampled, not a re-merged text.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from tito_addon.records.episode_segments import Segment
from tito_addon.records.record_models import Follows, RecordedImage, TurnRecord


class TokenRun(BaseModel):
    """A run of tokens, column by column (a 30k-token turn is 30k ids, not 30k objects)."""

    model_config = ConfigDict(extra="forbid")

    start: int  # the position of its first token in the turn's whole prompt + completion
    ids: list[int]
    texts: list[str] | None = None  # None: no tokenizer named them
    special: list[int] = []  # offsets (in this run) of the special tokens
    logprobs: list[float] | None = None  # sampled tokens only
    weight_versions: list[str | None] | None = None  # sampled tokens only


class SegmentPlace(BaseModel):
    """Which segment of its session's part of the episode a turn is in: numbered by first turn, as export numbers."""

    index: int
    first_turn: int
    call: str


class TurnTokens(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str
    turn_id: int
    parent_turn_id: int | None
    episode: str
    call: str
    follows: Follows | None = None
    segment: SegmentPlace | None = None  # None where the session's other turns were not read
    api: str
    model: str | None
    family: str
    tokenizer: str
    finish_reason: str | None
    weight_version: str | None
    prompt_len: int
    prompt_added: TokenRun
    completion: TokenRun
    images: list[RecordedImage] = []  # the images this turn's prompt added, each at its run of pads


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's own text, special tokens included."""
    if not ids:
        return []
    return list(
        tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    )


def special_ids(tokenizer: Any) -> set[int]:
    """Every id a tokenizer treats as special: its named special tokens and the added tokens marked special."""
    found = set(getattr(tokenizer, "all_special_ids", ()) or ())
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            found.add(int(token_id))
    return found


def token_run(ids: list[int], start: int, tokenizer: Any | None, specials: set[int]) -> TokenRun:
    texts = token_texts(tokenizer, ids) if tokenizer is not None else None
    return TokenRun(start=start, ids=ids, texts=texts, special=[k for k, i in enumerate(ids) if i in specials])


def turn_tokens(turn: TurnRecord, tokenizer: Any | None = None, *, segment: SegmentPlace | None = None) -> TurnTokens:
    """`turn` as tokens; texts and special marks only when `tokenizer` is given (it must be the turn's own)."""
    specials = special_ids(tokenizer) if tokenizer is not None else set()
    added = list(turn.prompt_added_ids)
    prompt = token_run(added, turn.prompt_len - len(added), tokenizer, specials)
    completion = token_run(list(turn.completion_ids), turn.prompt_len, tokenizer, specials)
    completion.logprobs = list(turn.completion_logprobs)
    versions = turn.token_weight_versions()
    completion.weight_versions = versions if any(v is not None for v in versions) else None
    return TurnTokens(
        session_id=turn.session_id,
        turn_id=turn.turn_id,
        parent_turn_id=turn.parent_turn_id,
        episode=turn.episode_id,
        call=turn.call,
        follows=turn.follows,
        segment=segment,
        api=turn.api,
        model=turn.model,
        family=turn.tokenizer.family,
        tokenizer=turn.tokenizer.name,
        finish_reason=turn.finish_reason,
        weight_version=turn.weight_version,
        prompt_len=turn.prompt_len,
        prompt_added=prompt,
        completion=completion,
        images=list(turn.images or ()),
    )


def segment_place(segments: Iterable[Segment], turn: TurnRecord) -> SegmentPlace | None:
    """The segment `turn` is in, among `segments` (`episode_segments`' order and numbers): the first that holds it,
    where branches share it."""
    for segment in segments:
        first = segment.path[0]
        if first.session_id == turn.session_id and any(t.turn_id == turn.turn_id for t in segment.path):
            return SegmentPlace(index=segment.index, first_turn=first.turn_id, call=segment.call)
    return None


# Shades of a sampled token by its probability: the less likely, the darker (blank: p >= 0.9).
SHADES = ((0.9, " "), (0.5, "░"), (0.1, "▒"), (0.01, "▓"), (0.0, "█"))


def shade(logprob: float) -> str:
    probability = math.exp(logprob)
    return next(mark for floor, mark in SHADES if probability >= floor)


def shown_text(text: str) -> str:
    """A token's text on one line: newlines, tabs and other control characters as visible marks."""
    return text.replace("\\", "\\\\").replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍")


# A run of one special token at least this long is one line (an image's hundreds of <|image_pad|>).
RUN_SHOWN_WHOLE = 8


def _token_lines(
    run: TokenRun, sampled: bool, turn_version: str | None = None, images: Sequence[RecordedImage] = ()
) -> list[str]:
    specials = set(run.special)
    image_at = {image.offset: image for image in images}
    out = []
    offset = 0
    while offset < len(run.ids):
        token = run.ids[offset]
        text = run.texts[offset] if run.texts is not None else None
        shown = "" if text is None else (f"⟦{text}⟧" if offset in specials else f"“{shown_text(text)}”")
        if not sampled and offset in specials:
            end = offset
            while end < len(run.ids) and run.ids[end] == token:
                end += 1
            if end - offset >= RUN_SHOWN_WHOLE:
                last = run.start + end - 1
                image = image_at.get(run.start + offset)
                named = f"  image {image.sha256[:12]} {image.width}×{image.height} {image.format}" if image else ""
                out.append(f"{run.start + offset:>7}  {token:>7}  {shown} × {end - offset} (to {last}){named}")
                offset = end
                continue
        if sampled and run.logprobs is not None:
            logprob = run.logprobs[offset]
            version = run.weight_versions[offset] if run.weight_versions else None
            # A token's weights are named where they differ from the turn's (a weight update inside the turn).
            weights = f"  w={version}" if version != turn_version else ""
            out.append(f"{run.start + offset:>7}  {shade(logprob)} {logprob:>9.4f}  {token:>7}  {shown}{weights}")
        else:
            out.append(f"{run.start + offset:>7}  {token:>7}  {shown}")
        offset += 1
    return out


def turn_text(view: TurnTokens) -> str:
    """The content view's text: the turn's place, then one token a line (position, id, text; sampled tokens with
    their shade and log-prob). Special tokens are in ⟦ ⟧, other text in “ ”."""
    parent = "none (a root)" if view.parent_turn_id is None else str(view.parent_turn_id)
    head = [
        f"tito turn {view.turn_id} of session {view.session_id}",
        f"  parent turn   {parent}",
        f"  episode       {view.episode}",
        f"  call          {view.call}",
    ]
    if view.segment is not None:
        head.append(f"  segment       {view.segment.index} (from turn {view.segment.first_turn}, {view.segment.call})")
    if view.follows is not None:
        link = view.follows
        call = f", tool call {link.tool_call_id}" if link.tool_call_id else ""
        head.append(f"  follows       session {link.session} turn {link.turn_id} (by {link.how}{call})")
    head += [
        f"  api           {view.api}",
        f"  model         {view.model or '-'} ({view.family} family, tokenizer {view.tokenizer})",
        f"  weights       {view.weight_version or 'not reported'}",
        f"  finish        {view.finish_reason or '-'}",
        f"  prompt        {view.prompt_len} tokens, {len(view.prompt_added.ids)} new in this turn",
        f"  completion    {len(view.completion.ids)} tokens sampled",
    ]
    if view.prompt_added.texts is None:
        head.append("  (no tokenizer loaded: ids only)")
    legend = "shade by probability: blank >= 0.9, ░ >= 0.5, ▒ >= 0.1, ▓ >= 0.01, █ below; ⟦special⟧"
    lines = [*head, "", f"── prompt, the part this turn added (positions {view.prompt_added.start}-"
                        f"{view.prompt_len - 1}) ──"]  # fmt: skip
    lines += _token_lines(view.prompt_added, sampled=False, images=view.images) or ["  (none)"]
    lines += ["", f"── completion ({legend}) ──", "    pos  shade   log-prob       id  text"]
    lines += _token_lines(view.completion, sampled=True, turn_version=view.weight_version) or ["  (none)"]
    return "\n".join(lines) + "\n"

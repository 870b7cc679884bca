"""Re-drive: score every recorded completion under a live backend (for example a newer checkpoint).

Each recorded turn's exact prompt + completion ids are sent for prompt scoring, and the new logprobs of the
recorded completion tokens are compared with the recorded rollout logprobs: the off-policy gap a trainer needs
to know. sglang scores with native `/generate` (`logprob_start_len`, `max_new_tokens: 0`); vLLM with
`/inference/v1/generate` and `prompt_logprobs: 0` (needs `--enable-scale-out` on 0.30+).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tito_addon.backends.image_features import placed_features
from tito_addon.backends.upstream_client import UpstreamClient
from tito_addon.chat_images import ImageRefused, PromptImage, image_from_bytes
from tito_addon.engine.vision_tokens import collapse_runs
from tito_addon.records.record_models import TurnRecord
from tito_addon.records.record_reader import RecordError, SessionFile, iter_session_files
from tito_addon.records.recorded_routes import routes_summary
from tito_addon.records.row_images import stored_images
from tito_addon.tito_errors import UpstreamMalformed, UpstreamPassthrough


@dataclass(frozen=True)
class TurnGap:
    session_id: str
    turn_id: int
    episode: str  # the turn's place in its episode, as recorded: a report can be read per call
    call: str
    tokens: int
    mean_abs_diff: float
    max_abs_diff: float
    # Mean of (recorded - new) over the sampled tokens: the Monte-Carlo estimate of KL(rollout || new) on this
    # turn; > 0 where the new policy finds what was sampled less likely.
    kl_estimate: float
    # Where the turn recorded MoE routes (`tito_routed_experts`): what `recorded_routes.routes_summary` says of its
    # sequence's, above all the weight versions they were routed under: replayed under the scored weights, routes of
    # other weights are another model's routing.
    routes: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class RedriveReport:
    turns: list[TurnGap] = field(default_factory=list)

    def totals(self, turns: list[TurnGap] | None = None) -> dict[str, Any]:
        turns = self.turns if turns is None else turns
        tokens = sum(t.tokens for t in turns)
        if not tokens:
            return {"turns": 0, "tokens": 0}
        weighted = lambda attr: sum(getattr(t, attr) * t.tokens for t in turns) / tokens  # noqa: E731
        return {
            "turns": len(turns),
            "tokens": tokens,
            "mean_abs_diff": weighted("mean_abs_diff"),
            "max_abs_diff": max(t.max_abs_diff for t in turns),
            "kl_estimate": weighted("kl_estimate"),
        }

    def routes_weights(self) -> dict[str, int]:
        """How many scored turns replay routes of each weight version (turns that recorded routes only)."""
        counts: dict[str, int] = {}
        for turn in self.turns:
            for version in (turn.routes or {}).get("weight_versions") or []:
                counts[version] = counts.get(version, 0) + 1
        return counts

    def by_call(self) -> dict[str, dict[str, Any]]:
        """The totals of each kind of call (main, compaction, subagent, side) the report holds."""
        calls = dict.fromkeys(t.call for t in self.turns)
        return {call: self.totals([t for t in self.turns if t.call == call]) for call in calls}


def gap(record: TurnRecord, new: list[float]) -> TurnGap:
    old = record.completion_logprobs
    diffs = [a - b for a, b in zip(old, new, strict=True)]
    count = len(diffs)
    return TurnGap(
        session_id=record.session_id,
        turn_id=record.turn_id,
        episode=record.episode_id,
        call=record.call,
        tokens=count,
        mean_abs_diff=sum(abs(d) for d in diffs) / count,
        max_abs_diff=max(abs(d) for d in diffs),
        kl_estimate=sum(diffs) / count,
    )


class Scorer:
    """Logprobs of `completion` given `prompt`, from a live backend."""

    def __init__(self, client: UpstreamClient, base_url: str, kind: str) -> None:
        if kind not in ("sglang", "vllm"):
            raise ValueError(f"unknown backend kind {kind!r}")
        self.client, self.base_url, self.kind = client, base_url.rstrip("/"), kind

    async def score(
        self,
        record: TurnRecord,
        prompt: list[int],
        completion: list[int],
        images: Sequence[PromptImage] = (),
    ) -> list[float]:
        """`images`: those the prompt holds, each with its run of pads in `prompt`: each engine is given them as it is
        on a turn (sglang one pad per image and `image_data`; vLLM the features render makes of them)."""
        if self.kind == "sglang":
            values = await self._sglang(prompt, completion, images)
        else:
            values = await self._vllm(record, prompt, completion, images)
        if len(values) != len(completion):
            raise UpstreamMalformed(f"backend scored {len(values)} of {len(completion)} completion tokens")
        for value in values:
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UpstreamMalformed(f"backend scored a token with a non-finite logprob: {value!r}")
        return [float(v) for v in values]

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.client.post_json(self.base_url + path, body, {})
        if response.status != 200:
            raise UpstreamPassthrough(response.status, response.body, response.content_type)
        parsed = response.json()
        if not isinstance(parsed, dict):
            raise UpstreamMalformed(f"{path} answered with JSON that is not an object")
        return parsed

    async def _sglang(self, prompt: list[int], completion: list[int], images: Sequence[PromptImage]) -> list[Any]:
        body: dict[str, Any] = {
            "input_ids": prompt + completion,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": len(prompt),
            "top_logprobs_num": 0,
        }
        if images:  # sglang expands one pad per image itself (the positions scored are those of the expanded ids)
            body["input_ids"] = collapse_runs(prompt + completion, [(image.offset, image.end) for image in images])
            body["image_data"] = [image.image.data_url() for image in images]
            body["return_prompt_token_ids"] = True
        answer = await self._post("/generate", body)
        if images and answer.get("prompt_token_ids") != prompt + completion:
            raise UpstreamMalformed("sglang expanded the images to other ids than the recorded ones")
        entries = (answer.get("meta_info") or {}).get("input_token_logprobs") or []
        scored = entries[: len(completion)]
        if [e[1] for e in scored if isinstance(e, list) and len(e) > 1] != completion:
            raise UpstreamMalformed("sglang scored other tokens than the recorded completion")
        return [e[0] for e in scored]

    async def _vllm(
        self, record: TurnRecord, prompt: list[int], completion: list[int], images: Sequence[PromptImage]
    ) -> list[Any]:
        body: dict[str, Any] = {
            "token_ids": prompt + completion,
            "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False},
            "stream": False,
        }
        if record.model:
            body["model"] = record.model
        if images:
            body["features"] = await self._vllm_features(record, images)
        rows = (await self._post("/inference/v1/generate", body)).get("prompt_logprobs")
        if not isinstance(rows, list) or len(rows) != len(prompt) + len(completion):
            raise UpstreamMalformed("vLLM returned no prompt_logprobs for the scored ids")
        values = []
        for token, row in zip(completion, rows[len(prompt) :], strict=True):
            entry = row.get(str(token)) if isinstance(row, dict) else None
            if not isinstance(entry, dict):
                raise UpstreamMalformed(f"vLLM prompt_logprobs has no entry for recorded token {token}")
            values.append(entry.get("logprob"))
        return values

    async def _vllm_features(self, record: TurnRecord, images: Sequence[PromptImage]) -> Any:
        """The images' features, as vLLM's render makes them (its processed pixels), placed on the recorded ids."""
        parts = [{"type": "image_url", "image_url": {"url": image.image.data_url()}} for image in images]
        chat = {"model": record.model, "messages": [{"role": "user", "content": parts}], "max_tokens": 1}
        rendered = await self._post("/v1/chat/completions/render", chat)
        return placed_features(rendered.get("features"), images)


def recorded_images(session_file: SessionFile, record: TurnRecord) -> list[PromptImage]:
    """The images of a recorded turn's prompt, with their bytes from its record dir's image store."""
    placed = session_file.sequence_images().get(record.turn_id) or []
    who = f"turn {record.turn_id} of {record.session_id}"
    out = []
    for image, data in stored_images(session_file, placed, who):
        try:
            out.append(PromptImage(image_from_bytes(data), image.offset, image.length))
        except ImageRefused as exc:
            raise RecordError(f"{who}: image {image.sha256}: {exc}") from None
    return out


async def redrive(record_dir: Path, scorer: Scorer, progress: Callable[[], None] | None = None) -> RedriveReport:
    report = RedriveReport()
    for session_file in iter_session_files(record_dir):
        ids = session_file.full_ids()
        for record in session_file.turns:
            prompt, completion = ids[record.turn_id]
            images = recorded_images(session_file, record)
            scored = gap(record, await scorer.score(record, prompt, completion, images))
            if record.routed_experts is not None:
                scored = dataclasses.replace(scored, routes=routes_summary(session_file, record.turn_id))
            report.turns.append(scored)
            if progress is not None:
                progress()
    return report

"""A turn with images on sglang: native `/generate` on our ids, the images beside them, answered as a chat attempt.

sglang's chat endpoint drops a request's images when it is given `input_ids` (0.5.13–0.5.23 build the request with
`image_data=None`), silently. `/generate` keeps them: it takes `input_ids` with one `<|image_pad|>` per image and
`image_data`, and expands each pad itself, keeping every other id as sent (`SGLANG_MM_AVOID_RETOKENIZE`, on by
default). Where that exact path fails it logs a warning and re-tokenizes, so every answer's `prompt_token_ids` (the ids
the model ran on, expanded) is compared with the proxy's own expansion; the two must be equal or nothing is recorded.
The answer is shaped as a chat attempt (`ChatAttempt`) so that the checks, the weight-update resumption and the parse
by the server's own parser routes are the chat path's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tito_addon.backends.backend_protocol import BackendResult, BackendTurn, StreamEnd, stream_end
from tito_addon.backends.resumed_generation import StitchedGeneration, fresh_request_id
from tito_addon.backends.sglang_attempts import ChatAttempt, checked_attempt, rest_of_message
from tito_addon.engine.vision_tokens import collapse_runs
from tito_addon.tito_errors import BadRequest, UpstreamMalformed

GENERATE_PATH = "/generate"
#: sglang keeps a client's ids beside images from 0.5.13, but until 0.5.20 a JPEG decoded on a CUDA server raises
#: inside the exact path and falls back to re-tokenizing (sglang#30368): 0.5.20 is the first version exact for all.
IMAGES_VERSION = (0, 5, 20)
#: Chat fields and the sampling params sglang's chat endpoint makes of them (`to_sampling_params`).
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "no_stop_trim": "no_stop_trim",
    "seed": "sampling_seed",
    "logit_bias": "logit_bias",
    "regex": "regex",
    "ebnf": "ebnf",
}
#: What the chat endpoint takes from the model's generation_config.json when the request leaves it unset (its
#: `--sampling-defaults model`, the default): `/generate` does not, so the proxy fills them in as chat would.
MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def check_version(version: tuple[int, ...] | None) -> None:
    if version is None or version < IMAGES_VERSION:
        shown = ".".join(map(str, version)) if version else "an unknown version"
        raise BadRequest(
            f"the backend is sglang {shown}: token-exact turns with images need sglang >= 0.5.20 (its /generate keeps "
            "the client's ids beside images from 0.5.13, and stops re-tokenizing JPEGs decoded on CUDA in 0.5.20); "
            "nothing was forwarded"
        )


#: Why an image turn cannot go through each router (measured: tests/full/test_image_routers.py).
ROUTERS_WITHOUT_IMAGES = {
    "vllm-router": "its /generate re-serialises the request without return_prompt_token_ids, so the engine's "
    "expansion of the images cannot be shown",
    "smg": "it routes none of sglang's parser routes (/detokenize, /separate_reasoning, /parse_function_call), "
    "which make the chat message of a /generate completion",
}


def check_router(router: str) -> None:
    why = ROUTERS_WITHOUT_IMAGES.get(router)
    if why is not None:
        raise BadRequest(
            f"turns with images cannot reach sglang through {router}: {why}; list the engines in tito_engines (no "
            "router) to serve them; nothing was forwarded"
        )


def sampling_params(chat_body: dict[str, Any], defaults: dict[str, Any], max_new_tokens: Any) -> dict[str, Any]:
    params = {key: defaults[key] for key in MODEL_DEFAULTS if key in defaults}
    for field, name in SAMPLING_FIELDS.items():
        if chat_body.get(field) is not None:
            params[name] = chat_body[field]
    stop = chat_body.get("stop")
    if stop is not None:
        params["stop"] = [stop] if isinstance(stop, str) else stop
    if max_new_tokens is not None:
        params["max_new_tokens"] = max_new_tokens
    # Chat keeps special tokens in the text when tools are active; the proxy parses the ids itself (parser routes).
    params["skip_special_tokens"] = False
    return params


def generate_body(turn: BackendTurn, stitched: StitchedGeneration, defaults: dict[str, Any]) -> dict[str, Any] | None:
    """The next engine request of the turn: its prompt (the turn's, then what earlier attempts sampled) with each
    image's run collapsed to the one pad sglang expands, every image of it as a data URL, its budget less what was
    sampled; None when nothing is left to sample."""
    budget = turn.chat_body.get("max_completion_tokens") or turn.chat_body.get("max_tokens")
    if budget is not None and stitched.ids:
        budget = stitched.left_of(budget)
        if budget == 0:
            return None
    top = turn.chat_body.get("top_logprobs")
    body: dict[str, Any] = {
        "rid": fresh_request_id(),
        "input_ids": collapse_runs(stitched.attempt_prompt(), [(image.offset, image.end) for image in turn.images]),
        "image_data": [image.image.data_url() for image in turn.images],
        "sampling_params": sampling_params(turn.chat_body, defaults, budget),
        "return_logprob": True,
        "logprob_start_len": -1,
        "return_text_in_logprobs": True,
        "return_prompt_token_ids": True,
        "stream": False,
    }
    if isinstance(top, int) and top > 0:
        body["top_logprobs_num"] = top
    if stitched.routes is not None:
        start = stitched.routes_start  # from where the last attempt's routes ended; a gap asks for none
        body["return_routed_experts"] = start is not None
        body["routed_experts_start_len"] = start or 0
    return body


def _entry(position: Sequence[Any], top: Any) -> dict[str, Any]:
    text = position[2] if len(position) > 2 and isinstance(position[2], str) else ""
    alternatives = []
    for alt in top if isinstance(top, list) else []:
        if isinstance(alt, (list, tuple)) and len(alt) > 2:
            label = alt[2] if isinstance(alt[2], str) else ""
            alternatives.append({"token": label, "logprob": alt[0], "bytes": list(label.encode())})
    return {"token": text, "logprob": position[0], "bytes": list(text.encode()), "top_logprobs": alternatives}


def generate_attempt(answer: Any, turn: BackendTurn, prompt_ids: list[int]) -> ChatAttempt:
    """A `/generate` answer as the chat attempt it stands for, checked the same way: the expanded ids it ran on must be
    the proxy's (`prompt_ids`: the turn's prompt and what earlier attempts sampled)."""
    if not isinstance(answer, dict) or not isinstance(answer.get("meta_info"), dict):
        raise UpstreamMalformed("sglang /generate answered without meta_info; nothing was recorded")
    meta = answer["meta_info"]
    echoed = answer.get("prompt_token_ids")
    if isinstance(echoed, list) and echoed != prompt_ids:
        at = next((i for i, (a, b) in enumerate(zip(echoed, prompt_ids, strict=False)) if a != b), None)
        at = min(len(echoed), len(prompt_ids)) if at is None else at
        raise UpstreamMalformed(
            f"sglang ran on other prompt ids than the proxy's ({len(echoed)} ids for {len(prompt_ids)}, first "
            f"different at {at}): its processor expanded an image to another count, or it fell back to "
            "re-tokenizing the prompt (its log says why); nothing was recorded"
        )
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else None
    top = meta.get("output_top_logprobs") or []
    positions = meta.get("output_token_logprobs") or []
    entries = [
        _entry(p, top[i] if i < len(top) else None) for i, p in enumerate(positions) if isinstance(p, (list, tuple))
    ]
    prompt_count = meta.get("prompt_tokens")
    completion_count = meta.get("completion_tokens")
    usage = None
    if type(prompt_count) is int and type(completion_count) is int:
        usage = {
            "prompt_tokens": prompt_count,
            "completion_tokens": completion_count,
            "total_tokens": prompt_count + completion_count,
        }
    body = {
        "id": meta.get("id"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": turn.chat_body.get("model"),
        "usage": usage,
        "choices": [
            {
                "index": 0,
                "message": None,
                "finish_reason": reason,
                "meta_info": meta,
                "prompt_token_ids": echoed,
                "logprobs": {"content": entries},
            }
        ],
    }
    return checked_attempt(body, prompt_ids, echo=True)


def reframed(turn: BackendTurn, result: BackendResult) -> list[dict[str, Any] | StreamEnd]:
    """A finished turn as a stream: the message's deltas, then its end (the finish chunk and usage follow the commit).
    An image turn runs whole, since `/generate` streams cumulative text, not the chat endpoint's deltas."""
    body = result.agent_body
    base = {key: body.get(key) for key in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    events: list[dict[str, Any] | StreamEnd] = []
    for delta in [{"role": "assistant", "content": ""}, *rest_of_message({}, result.message)]:
        events.append({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]})
    end = stream_end(
        turn,
        base,
        body["choices"][0]["message"],
        result.finish_reason,
        result.completion_ids,
        result.completion_logprobs,
    )
    end.result = result
    events.append(end)
    return events

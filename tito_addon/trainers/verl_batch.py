"""verl's padded batch from verl-layout rows: the `DataProto` its agent loop hands the trainer.

The shapes are those of verl's `AgentLoopWorker._agent_loop_postprocess` and `_postprocess`
(`verl/experimental/agent_loop/agent_loop.py`, read at b178a3cd; checked against the `verl` package from PyPI):
- `prompts` [B, P], left-padded; `responses` [B, R], right-padded; `input_ids` their concatenation;
- `attention_mask` [B, P + R] (1 on tokens), `position_ids` from it with verl's own `compute_position_id_with_mask`;
- `response_mask` [B, R]: 1 on sampled tokens only (tool results, user turns and padding 0), int64 like the rest;
- `rollout_log_probs` [B, R] float32, 0 off the sampled tokens;
- `rm_scores` [B, R] float32, the reward on the last response token, only when every row has a reward (a row with
  no response token gets it on its first padding position: verl reads scores as the sum over the row);
- non-tensor: `uid` (the GRPO group), `__num_turns__` (int32), and the row's `episode`, `rollout_id`, `index`,
  `segment`, `call`, `padded`, `tito_truncated`.

Truncation policy: P and R default to the longest prompt and response of the rows. A response longer than R is cut
to its first R tokens (verl's agent loop cuts the same way), its mask and log-probs with it, and the reward moves to
the last kept token; such rows are marked `tito_truncated`. A prompt longer than P is never cut (the sampled tokens
would then be scored under a context the model never saw): such rows are refused (`prompt_overflow="error"`, the
default) or left out (`"drop"`, which can leave a group short).

Run in verl's environment: `from tito_addon.trainers.verl_batch import verl_batch; batch = verl_batch("rows.parquet")`.
"""

from __future__ import annotations

from typing import Any

try:
    from tito_addon.trainers.row_files import Rows, read_rows, require_columns, routes_array
    from tito_addon.trainers.row_images import image_inputs, media_images
except ImportError:  # a copied file beside row_files.py
    from row_files import Rows, read_rows, require_columns, routes_array  # type: ignore[no-redef]
    from row_images import image_inputs, media_images  # type: ignore[no-redef,import-not-found]

VERL_COLUMNS = ("uid", "prompts", "responses", "response_mask", "rollout_log_probs", "rm_scores", "reward_score",
                "__num_turns__", "episode", "rollout_id", "index", "segment", "call", "padded")  # fmt: skip
PROMPT_OVERFLOW = ("error", "drop")


def verl_batch(
    rows: Rows,
    *,
    prompt_length: int | None = None,
    response_length: int | None = None,
    pad_token_id: int = 0,
    prompt_overflow: str = "error",
    processor: Any = None,
) -> Any:
    """A `verl.DataProto` of the rows (a verl-layout export's path, or its rows), padded as verl's agent loop pads.
    `pad_token_id` fills padding, which `attention_mask` hides from the model. Rows with images need `processor`, the
    model's (verl's `hf_processor(model_path)`; its `image_processor` and `tokenizer` are read): it makes each row's
    `multi_modal_inputs`, and the rows' `position_ids` are M-RoPE's `(bs, 4, P + R)`, as verl's agent loop makes
    them."""
    if prompt_overflow not in PROMPT_OVERFLOW:
        raise ValueError(f"prompt_overflow must be one of: {', '.join(PROMPT_OVERFLOW)}")
    found = read_rows(rows)
    require_columns(found, VERL_COLUMNS, "verl")
    if not found:
        raise ValueError("no rows")
    # Checked before torch is imported: a wrong length is the rows' matter, told in any environment.
    longest = longest_lengths(found)
    P = prompt_length if prompt_length is not None else max(len(r["prompts"]) for r in found)
    R = response_length if response_length is not None else max(max(len(r["responses"]) for r in found), 1)
    if P < 1 or R < 1:
        raise ValueError(f"prompt_length and response_length must be at least 1; {longest}")
    long = [r["index"] for r in found if len(r["prompts"]) > P]
    if long and prompt_overflow == "error":
        raise ValueError(f"{len(long)} rows have prompts longer than prompt_length={P} (rows {long[:10]}); {longest}: "
                         "raise prompt_length (left out, it is the longest prompt), or prompt_overflow='drop' leaves "
                         "them out")  # fmt: skip
    kept = [r for r in found if len(r["prompts"]) <= P]
    if not kept:
        raise ValueError(f"every row's prompt is longer than prompt_length={P}; {longest}")
    routes = [
        routes_array(r.get("routed_experts"), len(r["prompts"]) + len(r["responses"]), f"row {r['index']}")
        for r in kept
    ]
    if any(a is not None for a in routes) and any(a is None for a in routes):
        lacking = [r["index"] for r, a in zip(kept, routes, strict=True) if a is None][:10]
        raise ValueError(f"rows {lacking} have no routes (routed_experts_missing says why) while others do: routing "
                         "replay needs every row's")  # fmt: skip

    media = [media_images(r.get("multi_modal_data"), f"row {r['index']}") for r in kept]
    if any(media) and processor is None:
        raise ValueError("the rows hold images: pass processor= (the model's processor, as verl's agent loop has it)")

    import numpy as np
    import torch
    from verl import DataProto
    from verl.utils.model import compute_position_id_with_mask

    B = len(kept)
    prompts = torch.full((B, P), pad_token_id, dtype=torch.int64)
    responses = torch.full((B, R), pad_token_id, dtype=torch.int64)
    prompt_attention = torch.zeros((B, P), dtype=torch.int64)
    response_attention = torch.zeros((B, R), dtype=torch.int64)
    response_mask = torch.zeros((B, R), dtype=torch.int64)
    log_probs = torch.zeros((B, R), dtype=torch.float32)
    scored = all(r["reward_score"] is not None for r in kept)
    rm_scores = torch.zeros((B, R), dtype=torch.float32)
    truncated = np.zeros(B, dtype=bool)
    for i, row in enumerate(kept):
        prompt, response = row["prompts"], row["responses"][:R]
        truncated[i] = len(row["responses"]) > R
        n = len(response)
        if prompt:
            prompts[i, P - len(prompt) :] = torch.tensor(prompt, dtype=torch.int64)
            prompt_attention[i, P - len(prompt) :] = 1
        if n:
            responses[i, :n] = torch.tensor(response, dtype=torch.int64)
            response_attention[i, :n] = 1
            response_mask[i, :n] = torch.tensor(row["response_mask"][:R], dtype=torch.int64)
            log_probs[i, :n] = torch.tensor(row["rollout_log_probs"][:R], dtype=torch.float32)
        if scored:
            rm_scores[i, max(n - 1, 0)] = float(row["reward_score"])
    attention_mask = torch.cat([prompt_attention, response_attention], dim=1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "rollout_log_probs": log_probs,
    }
    if scored:
        tensors["rm_scores"] = rm_scores
    if routes and routes[0] is not None:
        tensors["routed_experts"] = placed_routes(kept, routes, P, R, torch)
    multi_modal: dict[str, Any] = {}
    if any(media):
        inputs = [
            image_inputs(processor, images, row["prompts"] + row["responses"], f"row {row['index']}") if images else {}
            for row, images in zip(kept, media, strict=True)
        ]
        for found_inputs in inputs:
            grid = found_inputs.get("image_grid_thw")
            if grid is not None:  # (verl's own addition to the processor's output)
                found_inputs["images_seqlens"] = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
        tensors["position_ids"] = rope_positions(processor, tensors["input_ids"], attention_mask, inputs, torch)
        multi_modal = {
            "multi_modal_data": np.array([{"images": images} if images else {} for images in media], dtype=object),
            "multi_modal_inputs": np.array(inputs, dtype=object),
        }
    non_tensors = {
        "uid": np.array([r["uid"] for r in kept], dtype=object),
        "__num_turns__": np.array([r["__num_turns__"] for r in kept], dtype=np.int32),
        "episode": np.array([r["episode"] for r in kept], dtype=object),
        "rollout_id": np.array([r["rollout_id"] for r in kept], dtype=np.int64),
        "index": np.array([r["index"] for r in kept], dtype=np.int64),
        "segment": np.array([r["segment"] for r in kept], dtype=np.int64),
        "call": np.array([r["call"] for r in kept], dtype=object),
        "padded": np.array([bool(r["padded"]) for r in kept], dtype=bool),
        "tito_truncated": truncated,
        **multi_modal,
    }
    meta = {
        "prompt_length": P,
        "response_length": R,
        "dropped_rows": len(found) - B,
        "truncated_rows": int(truncated.sum()),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)


def rope_positions(
    processor: Any, input_ids: Any, attention_mask: Any, inputs: list[dict[str, Any]], torch: Any
) -> Any:
    """`position_ids` `(bs, 4, L)`: each row's text positions over its tokens, then its three M-RoPE rows from verl's
    own Qwen2-VL `get_rope_index` (`verl/models/transformers/qwen2_vl.py`), as `_compute_position_ids` stacks them."""
    from verl.models.transformers.qwen2_vl import get_rope_index  # type: ignore[import-not-found]

    rows = []
    for i, found in enumerate(inputs):
        mask = attention_mask[i]
        vision = get_rope_index(
            processor, input_ids[i], image_grid_thw=found.get("image_grid_thw"), attention_mask=mask
        )
        text = torch.ones((1, mask.shape[0]), dtype=torch.long)
        valid = mask.bool()
        text[0, valid] = torch.arange(int(valid.sum()))
        rows.append(torch.cat((text, vision), dim=0))
    return torch.stack(rows)


def placed_routes(rows: list[dict[str, Any]], routes: list[Any], P: int, R: int, torch: Any) -> Any:
    """verl's `batch["routed_experts"]` for router replay R3 (`megatron_actor.py`, `router_replay_utils.
    set_router_replay_data`): `[bs, P + R, layers, topk]`, each row's routes laid where its ids are in `input_ids`
    (the prompt left-padded), zeros elsewhere, the last token's row zero, as verl's agent loop lays the engine's."""
    layers, topk = routes[0].shape[1:]
    out = torch.zeros((len(rows), P + R, layers, topk), dtype=torch.int32)
    for i, (row, array) in enumerate(zip(rows, routes, strict=True)):
        if array.shape[1:] != (layers, topk):
            raise ValueError(f"row {row['index']}: its routes are {array.shape[1:]}, the first row's {(layers, topk)}")
        cut = len(row["prompts"])
        values = torch.from_numpy(array.astype("int32"))
        out[i, P - cut : P] = values[:cut]
        rest = values[cut : cut + R]
        out[i, P : P + len(rest)] = rest
    return out


def longest_lengths(rows: list[dict[str, Any]]) -> str:
    """The longest prompt and response of the rows and which rows they are: what to set the lengths to."""

    def where(row: dict[str, Any]) -> str:
        return f"row {row['index']}, episode {row['episode']!r}, segment {row['segment']}"

    prompt = max(rows, key=lambda r: len(r["prompts"]))
    response = max(rows, key=lambda r: len(r["responses"]))
    return (f"the longest prompt is {len(prompt['prompts'])} tokens ({where(prompt)}), the longest response "
            f"{len(response['responses'])} ({where(response)})")  # fmt: skip

"""slime's rollout files from slime-layout rows: what `--load-debug-rollout-data DIR/{rollout_id}.pt` reads.

slime (github.com/THUDM/slime, read at 624b824a; not on PyPI) loads such a file with
`torch.load(path, weights_only=False)["samples"]` and builds each sample with `Sample.from_dict`
(`slime/observability/rollout_data_utils.py`, `slime/utils/types.py`). Each dict here holds exactly the fields of
`Sample.to_dict()` at that commit:
- the tokens, `response_length`, `loss_mask` and `rollout_log_probs` over the response, `prompt`/`response` text
  and `status` as the export wrote them;
- `group_index`, `index` and `rollout_id` as numbered across the export (a group's rows contiguous; an episode's
  segments share its `rollout_id`, so slime's loss counts the episode once);
- `reward` (a float: required, slime normalizes it by group) and `remove_sample` (the group's padding rows);
- `metadata` a dict: the driver's metadata with `tito` (episode, segment, call, group, turns, labels, model,
  tokenizer hashes) beside it.

slime's GRPO normalization reshapes rewards to `(-1, n_samples_per_prompt)` by position, so `write_rollout_files`
refuses rows whose groups are not contiguous; export them with `--group-size N` to have every group N rows long.

Run in slime's environment (it needs torch): `python -m tito_addon.trainers.slime_rollouts ROWS.parquet OUT_DIR`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

try:
    from tito_addon.trainers.row_files import Rows, read_rows, require_columns, routes_array
    from tito_addon.trainers.row_images import image_inputs, media_images
except ImportError:  # run as a copied file beside row_files.py
    from row_files import Rows, read_rows, require_columns, routes_array  # type: ignore[no-redef]
    from row_images import image_inputs, media_images  # type: ignore[no-redef,import-not-found]

SLIME_COLUMNS = ("group_index", "index", "rollout_id", "prompt", "tokens", "response", "response_length",
                 "loss_mask", "rollout_log_probs", "status", "reward", "padded")  # fmt: skip
# What slime has no field for, kept in the sample's metadata under "tito".
TITO_FIELDS = ("episode", "segment", "call", "group", "session_id", "turn_ids", "leaf_turn_id", "labels", "model",
               "tokenizer_sha256", "template_sha256")  # fmt: skip
SPEC_INFO = ("spec_accept_token_num", "spec_draft_token_num", "spec_verify_ct", "completion_token_num")
STATUSES = ("pending", "completed", "truncated", "aborted", "failed")


class SlimeRolloutError(ValueError):
    """Rows slime could not train on as they are (no reward, groups out of order)."""


def sample_of(row: dict[str, Any]) -> dict[str, Any]:
    """One slime-layout row as the dict `Sample.to_dict()` gives (624b824a)."""
    if row["reward"] is None:
        raise SlimeRolloutError(f"row {row['index']} (episode {row.get('episode')!r}) has no reward: slime needs one "
                                "on every sample (annotate the episode)")  # fmt: skip
    if len(row["loss_mask"]) != row["response_length"] or len(row["rollout_log_probs"]) != row["response_length"]:
        raise SlimeRolloutError(f"row {row['index']}: loss_mask and rollout_log_probs must be response_length long")
    if row["status"] not in STATUSES:
        raise SlimeRolloutError(f"row {row['index']}: unknown status {row['status']!r}")
    driver = json.loads(row["metadata"]) if row.get("metadata") else {}
    metadata = driver if isinstance(driver, dict) else {"metadata": driver}
    ours = {key: row.get(key) for key in TITO_FIELDS}
    label = metadata.get("label")
    return {
        "group_index": int(row["group_index"]),
        "index": int(row["index"]),
        "rollout_id": int(row["rollout_id"]),
        "prompt": row["prompt"],
        "tokens": [int(t) for t in row["tokens"]],
        "multimodal_inputs": None,
        "multimodal_train_inputs": None,
        "multimodal_train_input_id": None,
        "apply_chat_template_kwargs": {},
        "response": row["response"],
        "response_length": int(row["response_length"]),
        "label": label if isinstance(label, str) else None,
        "reward": float(row["reward"]),
        "loss_mask": [int(bit) for bit in row["loss_mask"]],
        "weight_versions": [v for v in row.get("weight_versions") or [] if v is not None],
        "rollout_log_probs": [float(lp) for lp in row["rollout_log_probs"]],
        "rollout_top_p_token_ids": None,
        "rollout_top_p_token_offsets": None,
        # (len(tokens) - 1, layers, topk) int32, as slime's Sample holds sglang's (`types.py`: the trainer asserts the
        # one row short, `cp_utils.prepare_routed_experts_for_routing_replay`); a tensor once written (`torch.save`).
        "rollout_routed_experts": routes_of(row),
        "remove_sample": bool(row.get("padded")),
        "teacher_log_probs": None,
        "status": row["status"],
        "metadata": {**metadata, "tito": ours},
        "generate_function_path": None,
        "custom_rm_path": None,
        "train_metadata": None,
        "session_id": row.get("session_id"),
        "non_generation_time": 0.0,
        "spec_info": dict.fromkeys(SPEC_INFO, 0),
        "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": 0},
    }


def routes_of(row: dict[str, Any]) -> Any:
    array = routes_array(row.get("rollout_routed_experts"), len(row["tokens"]), f"row {row['index']}")
    return None if array is None else array.astype("int32")


def rollout_batches(rows: Rows, *, groups_per_file: int | None = None) -> list[list[dict[str, Any]]]:
    """The samples of each rollout file: whole groups in export order, `groups_per_file` at a time (None: one file)."""
    found = read_rows(rows)
    require_columns(found, SLIME_COLUMNS, "slime")
    samples = [sample_of(row) for row in found]
    order = [s["group_index"] for s in samples]
    if order != sorted(order) or [s["index"] for s in samples] != list(range(len(samples))):
        raise SlimeRolloutError("the rows' groups are not contiguous in export order: write them with one export")
    if not samples:
        return []
    groups: dict[int, list[dict[str, Any]]] = {}
    for sample in samples:
        groups.setdefault(sample["group_index"], []).append(sample)
    per_file = groups_per_file or len(groups)
    listed = list(groups.values())
    return [sum(listed[k : k + per_file], []) for k in range(0, len(listed), per_file)]


def with_images(sample: dict[str, Any], media: Any, processor: Any) -> None:
    """A sample's images as slime's `Sample` holds them: the raw images (`multimodal_inputs`, `{"images": [PIL…]}`)
    and what the model's processor makes of them (`multimodal_train_inputs`: `pixel_values`, `image_grid_thw`, what
    slime's trainer passes to the model), checked against the sample's image tokens."""
    where = f"row {sample['index']}"
    images = media_images(media, where)
    if images is None:
        return
    if processor is None:
        raise SlimeRolloutError(
            f"{where} holds images: pass processor= (the model's processor, as slime's rollout has)"
        )
    sample["multimodal_inputs"] = {"images": images}
    sample["multimodal_train_inputs"] = image_inputs(processor, images, sample["tokens"], where)


def write_rollout_files(
    rows: Rows, out_dir: str | Path, *, groups_per_file: int | None = None, processor: Any = None
) -> list[Path]:
    """Write `OUT_DIR/0.pt`, `1.pt`, … (one per training step's rollout) and return their paths. Rows with images
    need `processor`, the model's (its `image_processor` and `tokenizer` are read)."""
    import torch

    found = read_rows(rows)
    media = {int(row["index"]): row.get("multimodal_inputs") for row in found}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for step, samples in enumerate(rollout_batches(found, groups_per_file=groups_per_file)):
        path = out / f"{step}.pt"
        for sample in samples:
            with_images(sample, media.get(sample["index"]), processor)
            if sample["rollout_routed_experts"] is not None:
                sample["rollout_routed_experts"] = torch.from_numpy(sample["rollout_routed_experts"])
        torch.save({"rollout_id": step, "samples": samples}, path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="slime's rollout files from rows exported with --format slime")
    parser.add_argument("rows", type=Path, help="the export (.parquet or .jsonl)")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--groups-per-file", type=int, help="groups per file: slime's rollout_batch_size")
    parser.add_argument("--processor", help="the model's directory, for rows with images (its processor is loaded)")
    args = parser.parse_args(argv)
    try:
        processor = None
        if args.processor:
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(args.processor, trust_remote_code=False)
        written = write_rollout_files(
            args.rows, args.out_dir, groups_per_file=args.groups_per_file, processor=processor
        )
    except (SlimeRolloutError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{len(written)} rollout files in {args.out_dir}: --load-debug-rollout-data {args.out_dir}/{{rollout_id}}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The loaders proven with the trainers' own code, in the trainer environment (`scripts/setup_trainers.sh`: Python
3.11, the CPU torch build, `verl` from PyPI): verl's padded batch goes through verl's own GRPO advantage step and the
advantages are those of the rewards the driver gave; slime's rollout files load with torch as slime loads them and
hold exactly the fields of slime's `Sample` (624b824a); verl's `RLHFDataset` reads the verl-dataset rows.

Skipped where the environment is not built, unless TITO_TRAINERS_REQUIRED=1 (CI), where that fails instead."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from support.basics import REPO, tokenizer_path
from support.proxy_harness import Mitmdump
from support.recorded_sessions import ROUTES_SHAPE, record_episodes

from tito_addon.replicas.expert_routing import expert_routes
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

pytestmark = [pytest.mark.full, pytest.mark.trainers]

TRAINERS = REPO / os.environ.get("TITO_TRAINERS_VENV", ".venv-trainers") / "bin" / "python"
CHECK = REPO / "tests" / "trainer_checks" / "check_loaders.py"
#: session -> (first request, group, reward): two groups of three, one of two, every reward known.
EPISODES = {
    "p0": ("Weather in Paris?", "paris", 1.0),
    "p1": ("Weather in Paris?", "paris", 0.0),
    "p2": ("Weather in Paris?", "paris", 0.5),
    "l0": ("Weather in Lima?", "lima", 0.25),
    "l1": ("Weather in Lima?", "lima", 1.0),
    "l2": ("Weather in Lima?", "lima", 0.75),
    "o0": ("Is it warm in Oslo?", "oslo", 1.0),
    "o1": ("Is it warm in Oslo?", "oslo", 0.0),
}
#: slime's `Sample.to_dict()` at 624b824a (slime/utils/types.py): every field, and the types its loader and trainer
#: read them as. The file holds no more and no fewer.
SAMPLE_FIELDS = {
    "group_index": int, "index": int, "rollout_id": int, "prompt": str, "tokens": list,
    "multimodal_inputs": type(None), "multimodal_train_inputs": type(None), "multimodal_train_input_id": type(None),
    "apply_chat_template_kwargs": dict, "response": str, "response_length": int, "label": (str, type(None)),
    "reward": float, "loss_mask": list, "weight_versions": list, "rollout_log_probs": list,
    "rollout_top_p_token_ids": type(None), "rollout_top_p_token_offsets": type(None),
    "rollout_routed_experts": type(None), "remove_sample": bool, "teacher_log_probs": type(None), "status": str,
    "metadata": dict, "generate_function_path": type(None), "custom_rm_path": type(None),
    "train_metadata": type(None), "session_id": (str, type(None)), "non_generation_time": float, "spec_info": dict,
    "prefix_cache_info": dict,
}  # fmt: skip
SAMPLE_STATUSES = {"pending", "completed", "truncated", "aborted", "failed"}


@pytest.fixture(scope="module")
def trainers() -> Path:
    if not TRAINERS.exists():
        if os.environ.get("TITO_TRAINERS_REQUIRED") == "1":
            pytest.fail(f"{TRAINERS} is missing: run scripts/setup_trainers.sh")
        pytest.skip("the trainer environment is not built (scripts/setup_trainers.sh)")
    return TRAINERS


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("train")
    record_episodes(out, EPISODES)
    return out


def export(record_dir: Path, out: Path, *args: str) -> Path:
    result = subprocess.run(
        [sys.executable, "-m", "tito_addon", "export", str(record_dir), str(out), *args],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return out


def in_trainers(trainers: Path, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run([str(trainers), *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stderr[-4000:]
    return result


def verl_report(trainers: Path, rows: Path, tmp_path: Path, **options) -> dict:
    out = tmp_path / "verl.json"
    in_trainers(trainers, str(CHECK), "verl", str(rows), str(out), json.dumps(options))
    return json.loads(out.read_text())


def test_verl_batch_is_padded_as_verl_pads_and_verls_grpo_gives_the_groups_advantages(
    trainers: Path, record_dir: Path, tmp_path: Path
) -> None:
    rows_path = export(record_dir, tmp_path / "rows.jsonl", "--format", "verl", "--to", "jsonl")
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    report = verl_report(trainers, rows_path, tmp_path)
    tensors, extra = report["tensors"], report["non_tensors"]
    P, R, B = max(len(r["prompts"]) for r in rows), max(len(r["responses"]) for r in rows), len(rows)
    shapes = {"prompts": [B, P], "responses": [B, R], "response_mask": [B, R], "input_ids": [B, P + R],
              "attention_mask": [B, P + R], "position_ids": [B, P + R], "rollout_log_probs": [B, R],
              "rm_scores": [B, R]}  # fmt: skip
    assert {k: tensors[k]["shape"] for k in shapes} == shapes
    assert {k: tensors[k]["dtype"] for k in shapes} == {
        **dict.fromkeys(["prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"],
                        "torch.int64"),
        "rollout_log_probs": "torch.float32", "rm_scores": "torch.float32",
    }  # fmt: skip
    # Files are read in name order: lima, oslo, paris, each group's rows together.
    assert extra["uid"] == [r["group"] for r in rows] == ["lima"] * 3 + ["oslo"] * 2 + ["paris"] * 3
    assert extra["__num_turns__"] == [r["__num_turns__"] for r in rows] and report["meta"]["truncated_rows"] == 0
    for i, row in enumerate(rows):
        prompt, response = row["prompts"], row["responses"]
        assert tensors["prompts"]["values"][i] == [0] * (P - len(prompt)) + prompt, "left-padded"
        assert tensors["responses"]["values"][i] == response + [0] * (R - len(response)), "right-padded"
        attention = [0] * (P - len(prompt)) + [1] * (len(prompt) + len(response)) + [0] * (R - len(response))
        assert tensors["attention_mask"]["values"][i] == attention
        assert tensors["position_ids"]["values"][i] == [max(sum(attention[: k + 1]) - 1, 0) for k in range(P + R)]
        assert tensors["response_mask"]["values"][i] == row["response_mask"] + [0] * (R - len(response))
        assert tensors["rollout_log_probs"]["values"][i] == pytest.approx(
            row["rollout_log_probs"] + [0.0] * (R - len(response)), abs=1e-6
        )
        scores = tensors["rm_scores"]["values"][i]
        assert scores[len(response) - 1] == row["reward"] and sum(scores) == row["reward"]
    # verl's GRPO over the batch: (reward - group mean) / (group std + 1e-6) on every sampled token, 0 elsewhere.
    rewards = {}
    for row in rows:
        rewards.setdefault(row["group"], []).append(row["reward"])
    for i, row in enumerate(rows):
        group = rewards[row["group"]]
        expected = (row["reward"] - statistics.mean(group)) / (statistics.stdev(group) + 1e-6)
        mask = tensors["response_mask"]["values"][i]
        assert report["advantages"][i] == pytest.approx([expected * bit for bit in mask], abs=1e-5)
    assert any(abs(a) > 0.5 for row in report["advantages"] for a in row), "the groups have a baseline"


def test_verl_batch_truncation_policy(trainers: Path, record_dir: Path, tmp_path: Path) -> None:
    rows_path = export(record_dir, tmp_path / "rows.parquet", "--format", "verl")
    rows = [json.loads(line) for line in export(record_dir, tmp_path / "r.jsonl", "--format", "verl", "--to",
                                                "jsonl").read_text().splitlines()]  # fmt: skip
    longest = max(len(r["responses"]) for r in rows)
    cut = longest - 3
    report = verl_report(trainers, rows_path, tmp_path, response_length=cut)
    tensors = report["tensors"]
    for i, row in enumerate(rows):
        truncated = len(row["responses"]) > cut
        assert report["non_tensors"]["tito_truncated"][i] == truncated
        kept = row["responses"][:cut]
        assert tensors["responses"]["values"][i] == kept + [0] * (cut - len(kept))
        assert tensors["response_mask"]["values"][i] == row["response_mask"][:cut] + [0] * (cut - len(kept))
        assert tensors["rm_scores"]["values"][i][len(kept) - 1] == row["reward"]
    assert report["meta"]["truncated_rows"] == sum(len(r["responses"]) > cut for r in rows) > 0
    shortest = min(len(r["prompts"]) for r in rows)
    refused = in_trainers(trainers, str(CHECK), "verl", str(rows_path), str(tmp_path / "x.json"),
                          json.dumps({"prompt_length": shortest}), check=False)  # fmt: skip
    assert refused.returncode != 0 and "prompts longer than prompt_length" in refused.stderr
    dropped = verl_report(trainers, rows_path, tmp_path, prompt_length=shortest, prompt_overflow="drop")
    kept_rows = [r for r in rows if len(r["prompts"]) <= shortest]
    assert dropped["meta"]["dropped_rows"] == len(rows) - len(kept_rows) > 0
    assert dropped["non_tensors"]["index"] == [r["index"] for r in kept_rows]


def test_slime_rollout_files_hold_slimes_sample_fields_in_whole_groups(
    trainers: Path, record_dir: Path, tmp_path: Path
) -> None:
    rows_path = export(record_dir, tmp_path / "rows.parquet", "--format", "slime", "--group-size", "3",
                       "--group-policy", "pad")  # fmt: skip
    folder = tmp_path / "rollout_data"
    made = in_trainers(trainers, "-m", "tito_addon.trainers.slime_rollouts", str(rows_path), str(folder),
                       "--groups-per-file", "2")  # fmt: skip
    assert f"2 rollout files in {folder}" in made.stdout
    out = tmp_path / "slime.json"
    in_trainers(trainers, str(CHECK), "slime", str(folder), str(out))
    files = json.loads(out.read_text())
    assert sorted(files) == ["0.pt", "1.pt"]
    assert [files[name]["rollout_id"] for name in ("0.pt", "1.pt")] == [0, 1]
    samples = files["0.pt"]["samples"] + files["1.pt"]["samples"]
    assert [len(files[name]["samples"]) for name in ("0.pt", "1.pt")] == [6, 3], "two groups, then one"
    assert [s["metadata"]["tito"]["group"] for s in samples] == ["lima"] * 3 + ["oslo"] * 3 + ["paris"] * 3
    for sample in samples:
        assert set(sample) == set(SAMPLE_FIELDS)
        for name, kind in SAMPLE_FIELDS.items():
            assert isinstance(sample[name], kind), (name, type(sample[name]))
        assert sample["status"] in SAMPLE_STATUSES
        assert len(sample["loss_mask"]) == len(sample["rollout_log_probs"]) == sample["response_length"] > 0
        assert all(isinstance(t, int) for t in sample["tokens"]) and set(sample["loss_mask"]) <= {0, 1}
        assert sample["metadata"]["tito"]["group"] in {"paris", "lima", "oslo"}
    # Groups contiguous and exactly n_samples_per_prompt long, as slime's reshape(-1, n) reads them.
    assert [s["group_index"] for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [s["index"] for s in samples] == list(range(9))
    oslo = samples[3:6]
    assert [s["remove_sample"] for s in samples] == [False] * 5 + [True] + [False] * 3
    assert set(oslo[2]["loss_mask"]) == {0} and oslo[2]["tokens"] == oslo[0]["tokens"]
    assert oslo[2]["reward"] == 0.5 and oslo[2]["rollout_id"] == oslo[0]["rollout_id"], "the group's mean reward"
    assert [s["reward"] for s in samples if not s["remove_sample"]] == [
        EPISODES[s["session_id"]][2] for s in samples if not s["remove_sample"]
    ]
    assert len({s["rollout_id"] for s in samples}) == 8, "one rollout id per episode"


def test_verl_dataset_rows_load_in_verls_rlhf_dataset(trainers: Path, record_dir: Path, tmp_path: Path) -> None:
    parquet = export(record_dir, tmp_path / "prompts.parquet", "--format", "verl-dataset")
    out = tmp_path / "dataset.json"
    in_trainers(trainers, str(CHECK), "dataset", str(parquet), str(tokenizer_path("qwen3")), str(out))
    items = json.loads(out.read_text())
    firsts = ("Weather in Lima?", "Is it warm in Oslo?", "Weather in Paris?")
    assert [item["raw_prompt"] for item in items] == [[{"role": "user", "content": first}] for first in firsts]
    assert [item["index"] for item in items] == [0, 1, 2]
    assert all(item["data_source"] == "tito" and item["reward_model"]["style"] == "rule" for item in items)


def test_the_example_drivers_file_is_read_as_groups_by_verl_and_slime(trainers: Path, tmp_path: Path) -> None:
    """examples/rollout_driver.py, 3 tasks x 2 samples through a real mitmdump: its one verl file gives verl's GRPO one
    group per task, and its one slime file becomes rollout files of whole two-sample groups."""
    token = "driver-token-0123456789abcdef"
    outs = {}
    with (
        ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica,
        Mitmdump("", tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path, mode="regular",
                 options={"tito_control_token": token}) as proxy,
    ):  # fmt: skip
        for layout in ("verl", "slime"):
            outs[layout] = tmp_path / f"{layout}.parquet"
            driver = subprocess.run(
                [
                    sys.executable, str(REPO / "examples" / "rollout_driver.py"), "--proxy", proxy.url, "--token",
                    token, "--base-url", replica.url + "/v1", "--tasks", "3", "--samples", "2", "--prefix", layout,
                    "--format", layout, "--out", str(outs[layout]),
                ],
                cwd=tmp_path, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            assert driver.returncode == 0, driver.stderr[-3000:]
            assert "6 rows in 3 groups" in driver.stdout
    report = verl_report(trainers, outs["verl"], tmp_path)
    assert report["non_tensors"]["uid"] == ["task-0"] * 2 + ["task-1"] * 2 + ["task-2"] * 2
    assert len(report["advantages"]) == 6
    folder = tmp_path / "rollout_data"
    in_trainers(trainers, "-m", "tito_addon.trainers.slime_rollouts", str(outs["slime"]), str(folder))
    out = tmp_path / "slime.json"
    in_trainers(trainers, str(CHECK), "slime", str(folder), str(out))
    samples = json.loads(out.read_text())["0.pt"]["samples"]
    assert [s["group_index"] for s in samples] == [0, 0, 1, 1, 2, 2]
    assert [s["metadata"]["tito"]["group"] for s in samples] == ["task-0"] * 2 + ["task-1"] * 2 + ["task-2"] * 2
    assert [s["rollout_id"] for s in samples] == [s["index"] for s in samples] == list(range(6))


@pytest.fixture(scope="module")
def routed_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("routed")
    record_episodes(out, {k: v for k, v in EPISODES.items() if k.startswith(("p", "l"))}, routes=True)
    return out


def engine_routes(ids: list[int]) -> list:
    layers, topk, experts = ROUTES_SHAPE
    return expert_routes(ids, 0, len(ids) - 1, layers, topk, experts).tolist()


def test_routes_reach_verls_batch_and_slimes_samples_aligned_with_the_ids(
    trainers: Path, routed_dir: Path, tmp_path: Path
) -> None:
    """R3: verl's `batch["routed_experts"]` [bs, P + R, layers, topk] holds each row's routes where its ids are in
    `input_ids` (zeros on padding and on the last token), and slime's samples hold int32 tensors one row shorter than
    their tokens, each row the engine's route of that position."""
    layers, topk, _ = ROUTES_SHAPE
    rows_path = export(routed_dir, tmp_path / "verl.parquet", "--format", "verl")
    report = verl_report(trainers, rows_path, tmp_path)
    tensor = report["tensors"]["routed_experts"]
    P, R = report["meta"]["prompt_length"], report["meta"]["response_length"]
    assert tensor["shape"] == [6, P + R, layers, topk] and tensor["dtype"] == "torch.int32"
    ids, mask = report["tensors"]["input_ids"]["values"], report["tensors"]["attention_mask"]["values"]
    for row, bits, routes in zip(ids, mask, tensor["values"], strict=True):
        where = [k for k, bit in enumerate(bits) if bit]  # the row's ids, in order, inside the padding
        sequence = [row[k] for k in where]
        assert [routes[k] for k in where[:-1]] == engine_routes(sequence)
        zero = [[0] * topk] * layers
        assert all(routes[k] == zero for k in range(P + R) if k not in where[:-1])

    slime_rows = export(routed_dir, tmp_path / "slime.parquet", "--format", "slime")
    folder = tmp_path / "slime_data"
    in_trainers(trainers, "-m", "tito_addon.trainers.slime_rollouts", str(slime_rows), str(folder))
    out = tmp_path / "slime.json"
    in_trainers(trainers, str(CHECK), "slime", str(folder), str(out))
    (only,) = json.loads(out.read_text()).values()
    assert only["routes_types"] == ["Tensor:torch.int32"] * 6
    for sample in only["samples"]:
        assert sample["rollout_routed_experts"] == engine_routes(sample["tokens"])


QWEN2_5_VL = {"size": {"shortest_edge": 3136, "longest_edge": 12845056}, "patch_size": 14}


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory) -> Path:
    """Two screenshot episodes of one group (rewards 1 and 0), recorded through a real mitmdump serving qwen2.5-vl."""
    import base64
    import io
    import time

    import openai
    from PIL import Image

    from tito_addon.records.record_models import AnnotationRecord
    from tito_addon.records.trajectory_recorder import TrajectoryRecorder

    out = tmp_path_factory.mktemp("images")
    record_dir = out / "rec"
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen2.5"), vision="qwen2.5-vl")
    settings = {"tokenizer": tokenizer_path("qwen2.5"), "family": "qwen2.5-vl", "record_dir": record_dir}
    with ReplicaThread(config) as replica, Mitmdump(replica.url, cwd=out, **settings) as proxy:
        for session, sizes in (("v0", [(84, 56), (56, 84)]), ("v1", [(112, 56), (70, 70)])):
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0,
                                   default_headers={"x-session-id": session})  # fmt: skip
            messages: list[dict] = []
            for width, height in sizes:
                shot = io.BytesIO()
                Image.new("RGB", (width, height), (width, height, 7)).save(shot, format="PNG")
                url = "data:image/png;base64," + base64.b64encode(shot.getvalue()).decode()
                messages.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                             {"type": "text", "text": "Next?"}]})  # fmt: skip
                reply = client.chat.completions.create(model="m", messages=messages, max_tokens=60)
                messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    recorder = TrajectoryRecorder(record_dir)
    for session, reward in (("v0", 1.0), ("v1", 0.0)):
        recorder.write_annotation(AnnotationRecord(session_id=session, ts=time.time(), reward=reward, group="shots"))
    return record_dir


def image_runs(ids: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of <|image_pad|> (151655)."""
    runs: list[tuple[int, int]] = []
    for k, token in enumerate(ids):
        if token == 151655:
            if runs and runs[-1][0] + runs[-1][1] == k:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((k, 1))
    return runs


def test_images_reach_verls_batch_and_slimes_samples_as_their_processors_make_them(
    trainers: Path, image_dir: Path, tmp_path: Path
) -> None:
    """verl: each row's `multi_modal_inputs` is the image processor's over its images, whose grids match the row's runs
    of image tokens, and `position_ids` are M-RoPE's (text positions, then temporal, height and width rows: an image's
    run spans its merged grid). slime: each sample's `multimodal_inputs` and `multimodal_train_inputs` likewise."""
    processor = {**QWEN2_5_VL, "tokenizer": tokenizer_path("qwen2.5")}
    rows_path = export(image_dir, tmp_path / "verl.parquet", "--format", "verl")
    report = verl_report(trainers, rows_path, tmp_path, processor=processor)
    P, R = report["meta"]["prompt_length"], report["meta"]["response_length"]
    positions = report["tensors"]["position_ids"]
    assert positions["shape"] == [2, 4, P + R]
    assert report["non_tensors"]["multi_modal_data"] == [[[84, 56], [56, 84]], [[112, 56], [70, 70]]]
    ids, mask = report["tensors"]["input_ids"]["values"], report["tensors"]["attention_mask"]["values"]
    for row, bits, inputs, pos in zip(ids, mask, report["non_tensors"]["multi_modal_inputs"], positions["values"],
                                      strict=True):  # fmt: skip
        where = [k for k, bit in enumerate(bits) if bit]
        sequence = [row[k] for k in where]
        grids = inputs["image_grid_thw"]["values"]
        runs = image_runs(sequence)
        assert [length for _, length in runs] == [t * h * w // 4 for t, h, w in grids]
        assert [pos[0][k] for k in where] == list(range(len(where)))  # the text row: 0.. over the row's tokens
        for (start, length), (_, h, w) in zip(runs, grids, strict=True):
            span = [where[start + k] for k in range(length)]
            rows_h, rows_w = [pos[2][k] for k in span], [pos[3][k] for k in span]
            assert max(rows_h) - min(rows_h) == h // 2 - 1 and max(rows_w) - min(rows_w) == w // 2 - 1
            assert len({pos[1][k] for k in span}) == 1  # one frame
    assert "advantages" in report

    slime_rows = export(image_dir, tmp_path / "slime.parquet", "--format", "slime")
    out = tmp_path / "slime-images.json"
    in_trainers(trainers, str(CHECK), "slime-images", str(slime_rows), str(tmp_path / "slime_data"), str(out),
                json.dumps(processor))  # fmt: skip
    samples = json.loads(out.read_text())
    assert [s["images"] for s in samples] == [[[84, 56], [56, 84]], [[112, 56], [70, 70]]]
    for sample in samples:
        runs = image_runs(sample["tokens"])
        assert [length for _, length in runs] == [t * h * w // 4 for t, h, w in sample["grid"]]
        assert sample["train"]["pixel_values"][0] == sum(t * h * w for t, h, w in sample["grid"])

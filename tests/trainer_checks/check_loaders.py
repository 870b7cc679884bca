"""Run in the trainer environment (.venv-trainers, scripts/setup_trainers.sh) by test_trainer_loaders.py beside it: feed
what tito_addon/trainers makes to verl's own code and torch's loader, and write what came out as JSON for the test.

    python check_loaders.py verl ROWS OUT.json OPTIONS_JSON     verl_batch, then verl's compute_advantage (GRPO)
    python check_loaders.py slime DIR OUT.json                  every DIR/*.pt as slime loads it (torch.load)
    python check_loaders.py dataset PARQUET TOKENIZER OUT.json  verl's RLHFDataset over verl-dataset rows
    python check_loaders.py slime-images ROWS DIR OUT.json PROCESSOR_JSON   slime_rollouts with images, loaded back

OPTIONS_JSON's `processor` (and PROCESSOR_JSON): `{"tokenizer": DIR, "size": {...}, "patch_size": N}`, the model's
processor made of its tokenizer and transformers' PIL image processor (the full processor needs torchvision, which
this CPU environment lacks).
"""

import json
import sys
from pathlib import Path


def plain(value):
    """numpy arrays and torch tensors as lists, inside dicts and lists too: what JSON holds."""
    if hasattr(value, "tolist") and not isinstance(value, (int, float, str)):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def processor_of(spec: dict):
    from types import SimpleNamespace

    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(size=spec["size"], patch_size=spec["patch_size"], merge_size=2)
    return SimpleNamespace(image_processor=image_processor, tokenizer=AutoTokenizer.from_pretrained(spec["tokenizer"]))


def media_summary(name: str, values) -> list:
    """What a batch's multimodal columns hold, without megabytes of pixels: shapes, grids, image sizes."""
    if name == "multi_modal_data":
        return [[list(image.size) for image in row.get("images", [])] for row in values]
    return [{k: {"shape": list(v.shape), "values": v.tolist() if k != "pixel_values" else None} for k, v in row.items()}
            for row in values]  # fmt: skip


def verl(rows: str, out: str, options: str) -> None:
    from verl import DataProto
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from tito_addon.trainers.verl_batch import verl_batch

    asked = json.loads(options)
    if "processor" in asked:
        asked["processor"] = processor_of(asked["processor"])
    batch = verl_batch(rows, **asked)
    assert isinstance(batch, DataProto)
    batch.check_consistency()
    tensors = {k: {"shape": list(v.shape), "dtype": str(v.dtype), "values": v.tolist()} for k, v in batch.batch.items()}
    media = ("multi_modal_data", "multi_modal_inputs")
    report = {
        "tensors": tensors,
        "non_tensors": {k: media_summary(k, v) if k in media else plain(v) for k, v in batch.non_tensor_batch.items()},
        "meta": batch.meta_info,
    }
    if "rm_scores" in batch.batch.keys():
        # What verl's trainer does next: the reward tensor becomes token_level_rewards, then its GRPO step.
        batch.batch["token_level_rewards"] = batch.batch["rm_scores"]
        batch = compute_advantage(batch, adv_estimator=AdvantageEstimator.GRPO, norm_adv_by_std_in_grpo=True)
        report["advantages"] = batch.batch["advantages"].tolist()
    Path(out).write_text(json.dumps(report))


def slime(folder: str, out: str) -> None:
    import torch

    files = {}
    for path in sorted(Path(folder).glob("*.pt")):
        # slime's load_debug_rollout_data reads with weights_only=False; the plain types load under True as well.
        raw = torch.load(path, weights_only=False)
        loaded, safe = plain(raw), plain(torch.load(path, weights_only=True))
        assert safe == loaded
        # slime's trainer takes the routes as a tensor (`torch.as_tensor`): what each sample's is, beside its values.
        loaded["routes_types"] = [
            None if s["rollout_routed_experts"] is None else f"{type(s['rollout_routed_experts']).__name__}:"
            f"{s['rollout_routed_experts'].dtype}" for s in raw["samples"]
        ]  # fmt: skip
        files[path.name] = loaded
    Path(out).write_text(json.dumps(files))


def dataset(parquet: str, tokenizer: str, out: str) -> None:
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    tok = AutoTokenizer.from_pretrained(tokenizer)
    config = OmegaConf.create({"cache_dir": str(Path(out).parent / "verl-cache"), "max_prompt_length": 4096})
    data = RLHFDataset(data_files=[parquet], tokenizer=tok, config=config)
    items = [data[k] for k in range(len(data))]
    keep = ("raw_prompt", "index", "data_source", "reward_model", "tools_kwargs")
    Path(out).write_text(json.dumps([{k: plain(item.get(k)) for k in keep} for item in items]))


def slime_images(rows: str, folder: str, out: str, spec: str) -> None:
    import torch

    from tito_addon.trainers.slime_rollouts import write_rollout_files

    write_rollout_files(rows, folder, processor=processor_of(json.loads(spec)))
    samples = []
    for path in sorted(Path(folder).glob("*.pt")):
        for sample in torch.load(path, weights_only=False)["samples"]:
            inputs, train = sample["multimodal_inputs"], sample["multimodal_train_inputs"]
            samples.append({
                "tokens": sample["tokens"],
                "images": None if inputs is None else [list(image.size) for image in inputs["images"]],
                "train": None if train is None else {k: list(v.shape) for k, v in train.items()},
                "grid": None if train is None else train["image_grid_thw"].tolist(),
            })  # fmt: skip
    Path(out).write_text(json.dumps(samples))


if __name__ == "__main__":
    commands = {"verl": verl, "slime": slime, "dataset": dataset, "slime-images": slime_images}
    commands[sys.argv[1]](*sys.argv[2:])

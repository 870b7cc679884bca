"""Run in the trainer environment (.venv-trainers, scripts/setup_trainers.sh) by test_trainer_loaders.py beside it: feed
what tito_addon/trainers makes to verl's own code and torch's loader, and write what came out as JSON for the test.

    python check_loaders.py verl ROWS OUT.json OPTIONS_JSON     verl_batch, then verl's compute_advantage (GRPO)
    python check_loaders.py slime DIR OUT.json                  every DIR/*.pt as slime loads it (torch.load)
    python check_loaders.py dataset PARQUET TOKENIZER OUT.json  verl's RLHFDataset over verl-dataset rows
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


def verl(rows: str, out: str, options: str) -> None:
    from verl import DataProto
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from tito_addon.trainers.verl_batch import verl_batch

    batch = verl_batch(rows, **json.loads(options))
    assert isinstance(batch, DataProto)
    batch.check_consistency()
    tensors = {k: {"shape": list(v.shape), "dtype": str(v.dtype), "values": v.tolist()} for k, v in batch.batch.items()}
    report = {
        "tensors": tensors,
        "non_tensors": {k: plain(v) for k, v in batch.non_tensor_batch.items()},
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


if __name__ == "__main__":
    {"verl": verl, "slime": slime, "dataset": dataset}[sys.argv[1]](*sys.argv[2:])

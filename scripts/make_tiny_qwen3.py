"""Writes a tiny random Qwen3 model (about 10 M parameters) with the real Qwen3 tokenizer, for the e2e tier.

Its outputs are noise, but it is a real model served by a real vLLM: prompts, ids, logprobs, parsers and
the scale-out endpoints all behave as they do for a production checkpoint.
usage: python make_tiny_qwen3.py OUT_DIR TOKENIZER_DIR   (in the vLLM venv: it needs torch)
"""

import shutil
import sys
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def main(out: Path, tokenizer: Path) -> None:
    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,  # vLLM's CPU attention needs >= 32
        max_position_embeddings=4096,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = [151645, 151643]
    model.generation_config.pad_token_id = 151643
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(tokenizer / name, out / name)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))

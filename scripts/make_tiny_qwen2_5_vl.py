"""Writes a tiny random Qwen2.5-VL (about 10 M parameters: a 2-layer text tower of width 64, a 2-block vision tower)
with the real Qwen2.5 tokenizer and Qwen2.5-VL's image processor settings, for the e2e tier's images.

Its outputs are noise, but it is a real vision-language model served by a real vLLM: render expands each image as
Qwen2.5-VL's processor does, generate runs the vision tower over the pixels and M-RoPE over the ids.
usage: python make_tiny_qwen2_5_vl.py OUT_DIR TOKENIZER_DIR   (in the vision-language vLLM venv: it needs torch)
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "tito_addon" / "engine" / "chat_templates" / "qwen2_5_vl_tools.jinja"


def main(out: Path, tokenizer: Path) -> None:
    text = {
        "vocab_size": 151936,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,  # head_dim 32: vLLM's CPU attention needs >= 32
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        # M-RoPE: the head's 16 rotary pairs split over time, height and width
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "tie_word_embeddings": True,
    }
    vision = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "out_hidden_size": 64,
        "fullatt_block_indexes": [1],
        "tokens_per_second": 2,
    }
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=151655, video_token_id=151656,
        vision_start_token_id=151652, vision_end_token_id=151653, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = [151645, 151643]
    model.generation_config.pad_token_id = 151643
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (tokenizer / name).exists() and not (name == "generation_config.json" and (out / name).exists()):
            shutil.copyfile(tokenizer / name, out / name)
    (out / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE.read_text()}, indent=2))
    # Qwen2.5-VL's own preprocessor_config.json values: the pixel bounds the proxy's qwen2.5-vl family counts with.
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
    }, indent=2))  # fmt: skip
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))

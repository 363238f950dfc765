"""Makes the real-engine tests' models: a tiny Llama with random weights (seeded, so every machine
makes the same one) and kvgate's test tokenizer, in one folder per chat template.

- tiny-llama-chatml: the tokenizer's own ChatML template, which loops over a message's content
  parts (vLLM's `auto` content format detects 'openai' for it);
- tiny-llama-plain: templates/plain.jinja, which uses content as one string ('string').

A folder that is complete is left as it is. Random weights give meaningless text; prefill cost,
prefix caching, KV events and cached-token counts are real.
"""

import argparse
import json
import os
import shutil
from pathlib import Path

SEED = 20261203
MODELS = {"tiny-llama-chatml": None, "tiny-llama-plain": "plain.jinja"}


def make_weights(folder: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(str(partial), safe_serialization=True)
    partial.rename(folder)


def make_model(out: Path, name: str, weights: Path, tokenizer_dir: Path, template: Path | None) -> None:
    folder = out / name
    if (folder / "tokenizer_config.json").is_file():
        return
    partial = out / (name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for item in weights.iterdir():
        os.symlink(item.resolve(), partial / item.name)
    shutil.copy(tokenizer_dir / "tokenizer.json", partial / "tokenizer.json")
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    if template is not None:
        config["chat_template"] = template.read_text()
    # Written last: its presence marks the folder complete.
    (partial / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--templates", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    weights = args.out / "weights"
    if not (weights / "config.json").is_file():
        make_weights(weights, args.tokenizer)
    for name, template in MODELS.items():
        make_model(args.out, name, weights, args.tokenizer, template and args.templates / template)
    print(args.out)


if __name__ == "__main__":
    main()

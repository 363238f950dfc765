#!/usr/bin/env python3
"""Trains testdata/tiny-chatml/tokenizer.json: a small byte-level BPE in the GPT-2/Qwen2 style.

Run from the repository root with the Python `tokenizers` package installed
(`pip install tokenizers`):

    python3 crates/kvgate-tokenizer/testdata/make_tokenizer.py

The corpus is this repository's docs plus a few non-English and emoji lines. The output is
committed; tests never run this script. Re-running it gives a different vocabulary (the docs
change, and the BPE trainer breaks ties in no fixed order), so reference.json must then be made
again with make_reference.py.
"""

import glob
import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
OUT = os.path.join(HERE, "tiny-chatml")
VOCAB_SIZE = 3000
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer split: contractions, letters with one leading non-letter, single digits,
# punctuation runs, newlines, and whitespace that keeps its last space for the next word.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
EXTRA_LINES = [
    "Der Gateway leitet Anfragen an die Replikate weiter, die den Präfix schon im Cache haben.",
    "La passerelle envoie chaque requête au moteur qui possède déjà le préfixe en mémoire.",
    "El enrutador elige la réplica con más bloques de caché compartidos.",
    "Шлюз направляет запросы к репликам с общим префиксом в кэше.",
    "网关根据缓存中的前缀把请求路由到合适的推理引擎副本。",
    "ゲートウェイはキャッシュに残っているプレフィックスで要求を振り分けます。",
    "게이트웨이는 캐시에 남아 있는 접두사로 요청을 라우팅합니다.",
    "تقوم البوابة بتوجيه الطلبات إلى النسخة التي تحتفظ بالبادئة في الذاكرة.",
    "गेटवे अनुरोधों को उस प्रतिकृति पर भेजता है जिसके कैश में उपसर्ग है।",
    "Emoji: 🚀 🔥 ✅ ❌ 🤖 👍🏽 👩‍💻 🇩🇪 🇯🇵 ❤️ 😀 🎉",
    "Γειά σου κόσμε · Olá, mundo · Dzień dobry · Merhaba dünya · Xin chào",
]


def corpus_lines():
    paths = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "ARCHITECTURE.md")]
    paths += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    paths.append(os.path.join(ROOT, "..", "shared", "STYLE.md"))
    lines = []
    for path in paths:
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                lines.extend(f.read().splitlines(keepends=True))
    # The extra lines are repeated so their characters survive as merges, not only bytes.
    return lines + EXTRA_LINES * 20


def main():
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    bos = "<|endoftext|>"
    bos_id = tokenizer.token_to_id(bos)
    # Completion prompts get a BOS (add_special_tokens=True), like Llama 3; chat prompts carry it
    # in the template's text instead ({{ bos_token }}), tokenized with add_special_tokens=False.
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)]
            ),
        ]
    )
    os.makedirs(OUT, exist_ok=True)
    tokenizer.save(os.path.join(OUT, "tokenizer.json"), pretty=False)
    write_config()
    print(f"vocab {tokenizer.get_vocab_size()} -> {OUT}/tokenizer.json, tokenizer_config.json")


def write_config():
    """tokenizer_config.json with the ChatML template from chatml.jinja.

    bos_token is written in the older AddedToken form and eos_token as a plain string, so that
    loaders are tested on both shapes.
    """
    with open(os.path.join(HERE, "chatml.jinja"), encoding="utf-8") as f:
        template = f.read()
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": {
            "__type": "AddedToken",
            "content": "<|endoftext|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        },
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    with open(os.path.join(OUT, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()

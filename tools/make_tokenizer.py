"""Train the project's small byte-level BPE tokenizer on CPython's own standard-library sources.

The vocabulary has 8,000 ids. The special tokens take ids 0-3, in this order: `<|endoftext|>` (eos and pad),
`<|mask|>` (the diffusion mask token), `<|im_start|>`, `<|im_end|>`; the 256 byte symbols and the merges follow.
Byte-level pre-tokenization and decoding, with no normalizer, make every UTF-8 string round-trip exactly.

    python tools/make_tokenizer.py --out jaxllm/default_model
"""

import argparse
import json
import sysconfig
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 8000
EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, MASK_TOKEN, IM_START_TOKEN, IM_END_TOKEN]
# Enough text for 7.7k merges; more only slows training down.
CORPUS_CAP_BYTES = 8 * 1024 * 1024
MODEL_MAX_LENGTH = 32768

# ChatML as Qwen writes it, without a default system prompt. Content may be a string or a list of OpenAI text parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def stdlib_source_files() -> list[Path]:
    """The standard library's *.py files in sorted order, leaving out installed third-party packages."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = (p for p in stdlib.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts))
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def read_corpus(files: list[Path], cap_bytes: int) -> list[str]:
    """Texts of the first files in order until cap_bytes is reached; files that are not UTF-8 are skipped."""
    texts, total_bytes = [], 0
    for path in files:
        if total_bytes >= cap_bytes:
            break
        data = path.read_bytes()
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        total_bytes += len(data)
    return texts


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # All 256 bytes are in the vocabulary even when the corpus lacks some, so nothing maps to an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer) -> dict:
    """The transformers side: which token plays which role, the chat template, and no decode-time space cleanup."""
    added_tokens_decoder = {
        str(tokenizer.token_to_id(token)): {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "mask_token": MASK_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config_text = json.dumps(tokenizer_config(tokenizer), indent=2, ensure_ascii=False) + "\n"
    (out_dir / "tokenizer_config.json").write_text(config_text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for tokenizer.json and its config")
    parser.add_argument("--cap-mb", type=float, default=CORPUS_CAP_BYTES / 2**20, help="corpus size cap in MiB")
    args = parser.parse_args()

    start = time.perf_counter()
    texts = read_corpus(stdlib_source_files(), int(args.cap_mb * 2**20))
    tokenizer = train_tokenizer(texts)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    assert [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    write_tokenizer(tokenizer, args.out)
    corpus_mb = sum(len(text.encode()) for text in texts) / 2**20
    print(f"trained {VOCAB_SIZE} ids on {len(texts)} files ({corpus_mb:.1f} MiB) in "
          f"{time.perf_counter() - start:.1f} s -> {args.out}")


if __name__ == "__main__":
    main()

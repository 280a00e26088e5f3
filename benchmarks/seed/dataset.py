"""The prompts sent to the simulated workers: a ShareGPT-shaped JSON file for `vllm bench serve
--dataset-name sharegpt`, whose prompts the simulator counts as exactly N tokens each. Pure.

Why not vLLM's `random` dataset there: it draws token ids from the tokenizer it is given, here
the tiny local model's (a 670-token vocabulary), and 512 of them decode to 300-1500 characters.
The simulator counts a prompt as MinerU's Qwen2 tokenizer roughly would, 4 characters a token
plus the chat template (`mineru_gateway.prompts`), so those prompts weighed 71-384 tokens there
(mean 224 over 64 prompts), not 512. Real vLLM counts with the tiny tokenizer itself, so the
real-vLLM check keeps the `random` dataset, which is exact there.

Why ShareGPT's shape: vllm bench reads its `custom` JSONL with pandas, which vLLM's CPU build
does not install; its ShareGPT loader reads plain JSON. That loader drops prompts of more than
1024 tokens, or more than 2048 with the answer, as its tokenizer (the tiny model's) counts them:
the words below are one token each there, so a 512-token prompt is about 270 of them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from mineru_gateway import prompts

# One token each in the tiny model's tokenizer (scripts/build_tiny_model.py trains it on a text
# about this project), and no MinerU task prompt among them, so the simulator treats every
# prompt alike.
WORDS = (
    "documents",
    "requests",
    "rendered",
    "language",
    "formulas",
    "latency",
    "metrics",
    "workers",
    "gateway",
    "figures",
    "several",
    "results",
    "weather",
    "exports",
    "streams",
    "events",
    "tokens",
    "server",
    "blocks",
    "titles",
    "flight",
    "routes",
    "layout",
    "vision",
    "image",
    "every",
    "model",
    "table",
)


def counted_tokens(text: str) -> int:
    """Prompt tokens of one user message as the simulator (and the gateway's router) count them."""
    return prompts.estimate_chat(1, [text], []).tokens


def prompt_text(tokens: int, rng: random.Random) -> str:
    """Random words cut to the length that `counted_tokens` makes exactly `tokens`."""
    chars = prompts.CHARS_PER_TOKEN * (tokens - counted_tokens(""))
    if chars <= 0:
        raise ValueError(f"{tokens} tokens do not cover the chat template's own")
    words: list[str] = []
    length = -1
    while length < chars:
        words.append(rng.choice(WORDS))
        length += len(words[-1]) + 1
    return " ".join(words)[:chars]


def write_prompts(path: Path, count: int, tokens: int, seed: int) -> Path:
    """`count` distinct prompts of `tokens` tokens each, as ShareGPT conversations (the answer
    is empty: `--sharegpt-output-len` sets its length)."""
    rng = random.Random(seed)
    conversations = [
        {"conversations": [{"from": "human", "value": prompt_text(tokens, rng)}, _ANSWER]}
        for _ in range(count)
    ]
    path.write_text(json.dumps(conversations) + "\n")
    return path


_ANSWER = {"from": "gpt", "value": ""}

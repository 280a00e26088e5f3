"""What a MinerU request costs and answers: prompt tokens, answer length, answer text. Pure.

Prompt tokens and prompt kinds come from `mineru_gateway.prompts`, shared with the gateway.

Answer lengths are drawn from a log-normal per MinerU prompt kind, seeded by the request's content,
so the same request always gets the same answer. Layout answers list every block of the page at ~23
tokens a block (hundreds to ~2000 tokens); block recognitions are shorter (text and formulas tens of
tokens, tables hundreds). Together they give ~1100 output tokens per page as in the MinerU2.5 paper.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass

from mineru_gateway.prompts import PromptKind

SEED_SAMPLE_CHARS = 4096


@dataclass(frozen=True, slots=True)
class LengthModel:
    median: float
    sigma: float
    low: int
    high: int


LENGTH_MODELS = {
    PromptKind.LAYOUT: LengthModel(median=500, sigma=0.5, low=40, high=2500),
    PromptKind.TEXT: LengthModel(median=30, sigma=0.9, low=1, high=2000),
    PromptKind.TABLE: LengthModel(median=400, sigma=0.7, low=20, high=4000),
    PromptKind.FORMULA: LengthModel(median=40, sigma=0.7, low=3, high=1000),
    PromptKind.OTHER: LengthModel(median=100, sigma=0.8, low=1, high=2000),
}

LAYOUT_BLOCKS = 45  # distinct blocks a layout answer lists before its text repeats


def _layout_block(index: int) -> tuple[str, ...]:
    """One block of a layout answer, 22 tokens, as MinerU2.5 writes it: its box (0-999 on each
    axis), type and rotation. Each block has a band of the page to itself: MinerU's client
    drops a block whose box overlaps another of its type too much, and then makes no request
    for it. Mostly text, an equation every twelfth (tables are rare and long)."""
    top = 10 + 22 * index
    box = f"{100:03d} {top:03d} {900:03d} {top + 18:03d}"
    kind = "equation" if index % 12 == 5 else "text"
    return (
        "<|box_start|>",
        *box,  # one token a character: 15
        "<|box_end|>",
        "<|ref_start|>",
        kind,
        "<|ref_end|>",
        "<|rotate_up|>",
        "\n",
    )


# Answer text, one string per token, cycled; shaped like MinerU2.5's outputs. A layout answer
# lists up to LAYOUT_BLOCKS distinct blocks, one per ~22 tokens: a median page (500 tokens)
# then asks MinerU's client for ~22 block requests (a page has about 10-30,
# docs/mineru-client.md, "The load per page").
VOCABULARY = {
    PromptKind.LAYOUT: tuple(token for i in range(LAYOUT_BLOCKS) for token in _layout_block(i)),
    PromptKind.TEXT: (
        " The",
        " quick",
        " brown",
        " fox",
        " jumps",
        " over",
        " the",
        " lazy",
        " dog.",
    ),
    PromptKind.TABLE: ("<table>", "<tr>", "<td>", "cell", "</td>", "<td>", "42", "</td>", "</tr>"),
    PromptKind.FORMULA: ("\\frac", "{", "a", "}", "{", "b", "}", " +", " c"),
    PromptKind.OTHER: (" lorem", " ipsum", " dolor", " sit", " amet", ","),
}


def content_seed(parts: list[str], seed: int) -> int:
    """A seed that depends only on the prompt's content (not on `stream` or ids)."""
    digest = seed & 0xFFFFFFFF
    for part in parts:
        digest = zlib.crc32(_sample(part).encode("utf-8", "surrogatepass"), digest)
    return digest


def _sample(part: str) -> str:
    # Images are megabytes of base64: their ends and length identify them well enough.
    if len(part) <= 2 * SEED_SAMPLE_CHARS:
        return part
    return f"{part[:SEED_SAMPLE_CHARS]}{len(part)}{part[-SEED_SAMPLE_CHARS:]}"


def draw_length(kind: PromptKind, seed: int) -> int:
    model = LENGTH_MODELS[kind]
    value = random.Random(seed).lognormvariate(math.log(model.median), model.sigma)
    return min(model.high, max(model.low, round(value)))


@dataclass(frozen=True, slots=True)
class Answer:
    """How many tokens a request generates, and why it stops."""

    tokens: int
    finish_reason: str


def plan_answer(drawn: int, max_tokens: int, min_tokens: int, ignore_eos: bool) -> Answer:
    """vLLM's rules: EOS is not honoured before `min_tokens` nor with `ignore_eos`; `max_tokens`
    always stops the answer, with finish reason `length`."""
    wanted = max_tokens if ignore_eos else max(drawn, min_tokens)
    if wanted < max_tokens:
        return Answer(wanted, "stop")
    return Answer(max_tokens, "length")


def answer_text(kind: PromptKind, tokens: int) -> str:
    vocabulary = VOCABULARY[kind]
    cycles, rest = divmod(tokens, len(vocabulary))
    return "".join(vocabulary) * cycles + "".join(vocabulary[:rest])

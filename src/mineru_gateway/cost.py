"""What a request will cost a worker, in batch-slot units, learnt as traffic flows. Pure.

MinerU traffic mixes full-page layout requests (a 1036x1036 image, hundreds to thousands of output
tokens) with many small block requests (tens of tokens): counting requests treats them as equal
(issue 3). A request's cost is

    1 + prefill_weight * prompt_tokens + decode_weight * expected_decode_tokens

- The unit is one sequence in the worker's running batch. Under continuous batching, what delays a
  new request's first token is how many sequences share each engine step (step time grows with
  the batch) and how much prefill is queued ahead of it; a long answer does not block anyone, it
  only holds its slot for longer. Weighting whole answers as work (a layout request as ~25 block
  requests) made routing avoid a worker for seconds because of one long answer and lost to plain
  request counting on TTFT p99 (benchmarks/results/routing.md); so cost stays close to a count.
- `prefill_weight` 0.001: a 1036x1036 page (1369 visual tokens) adds ~1.4 slots: its prefill
  costs about as much engine time as a step of a full batch (~55 ms on a 910B, sim/config.py).
- `decode_weight` 0.002: a 1000-token layout answer adds 2 slots, for the steps it occupies.
- Expected decode is learnt per request class (model, MinerU task, image or not) as a moving
  average of observed completion lengths, capped by `max_tokens`; `ignore_eos` means `max_tokens`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from mineru_gateway.prompts import PromptEstimate

ClassKey = tuple[str, str, bool]


@dataclass(frozen=True, slots=True)
class CostInputs:
    model: str
    prompt: PromptEstimate
    max_tokens: int | None
    ignore_eos: bool

    @property
    def key(self) -> ClassKey:
        return (self.model, self.prompt.kind.value, self.prompt.has_image)


class CostModel:
    """Estimates request costs and learns completion lengths; bounded memory (LRU of classes)."""

    def __init__(
        self,
        *,
        prefill_weight: float = 0.001,
        decode_weight: float = 0.002,
        default_decode_tokens: float = 256.0,
        smoothing: float = 0.1,
        max_classes: int = 256,
    ) -> None:
        self.prefill_weight = prefill_weight
        self.decode_weight = decode_weight
        self.default_decode_tokens = default_decode_tokens
        self.smoothing = smoothing
        self.max_classes = max_classes
        self._decode: OrderedDict[ClassKey, float] = OrderedDict()
        self.mean_cost = 1.0 + prefill_weight * 100 + decode_weight * default_decode_tokens

    def expected_decode(self, inputs: CostInputs) -> float:
        if inputs.ignore_eos and inputs.max_tokens is not None:
            return float(inputs.max_tokens)
        learnt = self._decode.get(inputs.key, self.default_decode_tokens)
        return learnt if inputs.max_tokens is None else min(learnt, inputs.max_tokens)

    def estimate(self, inputs: CostInputs) -> float:
        cost = (
            1.0
            + self.prefill_weight * inputs.prompt.tokens
            + self.decode_weight * self.expected_decode(inputs)
        )
        self.mean_cost += self.smoothing * (cost - self.mean_cost)
        return cost

    def learn(self, inputs: CostInputs, completion_tokens: int) -> None:
        key = inputs.key
        previous = self._decode.pop(key, None)
        if previous is None:
            learnt = float(completion_tokens)
            while len(self._decode) >= self.max_classes:
                self._decode.popitem(last=False)
        else:
            learnt = previous + self.smoothing * (completion_tokens - previous)
        self._decode[key] = learnt

    def classes(self) -> int:
        return len(self._decode)

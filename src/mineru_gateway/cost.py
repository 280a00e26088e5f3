"""What a request will cost a worker, in decode-token units, learnt as traffic flows. Pure.

MinerU traffic mixes full-page layout requests (a 1036x1036 image, hundreds to thousands of output
tokens) with many small block requests (tens of tokens): counting requests treats them as equal
(issue 3). A request's cost is `prefill_weight * prompt_tokens + expected_decode_tokens`:
- decode dominates: a request holds a batch slot for every token it generates;
- a prefill token costs a fraction of a decode step's per-sequence share (on a 910B with
  MinerU2.5, ~40 us per prefill token against ~0.4 ms per sequence-step: weight 0.1);
- expected decode is learnt per request class (model, MinerU task, image or not) as a moving
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
        prefill_weight: float = 0.1,
        default_decode_tokens: float = 256.0,
        smoothing: float = 0.1,
        max_classes: int = 256,
    ) -> None:
        self.prefill_weight = prefill_weight
        self.default_decode_tokens = default_decode_tokens
        self.smoothing = smoothing
        self.max_classes = max_classes
        self._decode: OrderedDict[ClassKey, float] = OrderedDict()
        self.mean_cost = prefill_weight * 100 + default_decode_tokens

    def expected_decode(self, inputs: CostInputs) -> float:
        if inputs.ignore_eos and inputs.max_tokens is not None:
            return float(inputs.max_tokens)
        learnt = self._decode.get(inputs.key, self.default_decode_tokens)
        return learnt if inputs.max_tokens is None else min(learnt, inputs.max_tokens)

    def estimate(self, inputs: CostInputs) -> float:
        cost = self.prefill_weight * inputs.prompt.tokens + self.expected_decode(inputs)
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

"""What a request will cost a worker, in running-batch slots, learnt as traffic flows. Pure.

MinerU traffic mixes full-page layout requests (a 1036x1036 image, hundreds to thousands of output
tokens) with many small block requests (tens of tokens): counting requests treats them as equal.
A request's cost has two parts:

    prefill = prefill_weight * prompt_tokens          (until its first byte comes back)
    hold    = 1 + decode_weight * expected_decode_tokens   (until it ends)

- The unit is one sequence in the worker's running batch: under continuous batching a new
  request's first token waits on how many sequences share each engine step (`max_num_seqs` caps
  them) and on the prefill queued ahead of it. A long answer only holds its slot for longer.
- `prefill_weight` 0.001: a 1036x1036 page (1369 visual tokens) adds ~1.4 slots until its
  prefill is done, about a step of a full batch on a 910B (sim/config.py).
- `decode_weight` 0 by default: expected answer lengths are learnt per class (model, MinerU
  task, image or not; capped by `max_tokens`; `ignore_eos` means `max_tokens`) and can be
  weighted. Why these defaults, measured: README, "Routing evidence".

Flow control (flow.py) shares the tenants' fleet on the same estimate.
"""

from __future__ import annotations

from collections import OrderedDict

from mineru_gateway.prompts import PromptEstimate, PromptKind
from mineru_gateway.values import value

ClassKey = tuple[str, PromptKind, bool]


@value
class Cost:
    """Estimated cost in batch slots: `prefill` until the first byte, `hold` until the end."""

    prefill: float
    hold: float

    @property
    def total(self) -> float:
        return self.prefill + self.hold


@value
class CostInputs:
    model: str
    prompt: PromptEstimate
    max_tokens: int | None
    ignore_eos: bool

    @property
    def key(self) -> ClassKey:
        # The member, not its `.value`: an enum's value is a descriptor call in Python 3.11.
        return (self.model, self.prompt.kind, self.prompt.has_image)


class CostModel:
    """Estimates request costs and learns completion lengths; bounded memory (LRU of classes)."""

    def __init__(
        self,
        *,
        prefill_weight: float = 0.001,
        decode_weight: float = 0.0,
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

    def expected_decode(self, inputs: CostInputs) -> float:
        if inputs.ignore_eos and inputs.max_tokens is not None:
            return float(inputs.max_tokens)
        learnt = self._decode.get(inputs.key, self.default_decode_tokens)
        return learnt if inputs.max_tokens is None else min(learnt, inputs.max_tokens)

    def estimate(self, inputs: CostInputs) -> Cost:
        return Cost(
            prefill=self.prefill_weight * inputs.prompt.tokens,
            hold=1.0 + self.decode_weight * self.expected_decode(inputs),
        )

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

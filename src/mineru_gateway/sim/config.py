"""The simulator's settings: one frozen dataclass whose defaults describe one Ascend 910B (Atlas A2)
serving MinerU2.5-2509-1.2B with vLLM-Ascend, and the CLI flags that fill it.

Where the defaults come from (docs/vllm.md, docs/vllm-ascend.md and docs/mineru-client.md unless
said otherwise):

- Throughput anchor: the MinerU2.5 paper measured 2.12 pages/s and 2337 output tokens/s on one
  A100 with vLLM (OmniDocBench, about 1100 output tokens per page). No 910B figure is published; a
  910B is assumed A100-class (bf16 ~320 TFLOPS vs 312, HBM 64 GB at ~1.6 TB/s vs 1.6-2.0 TB/s).
  With the step model below, a saturated worker serving MinerU's page mix (a layout pass, then
  ~12 blocks per page) does ~2.1 pages/s and ~2600 output tokens/s (its synthetic pages carry
  ~1250 output tokens); tests/sim/test_engine.py keeps it within 1.7-2.6 pages/s.
- Step model: `step = base + per_seq * batch + per_prefill_token * prefill_tokens`.
  `base` 10 ms: one decode step of a 0.5B Qwen2 decoder on vLLM-Ascend, dominated by host-side
  scheduling and operator launch rather than the NPU (single-stream ~100 tokens/s).
  `per_seq` 0.2 ms: per-sequence host work each step (sampling, detokenising, and MinerU's Python
  logits processor with `no_repeat_ngram_size=100`), which outweighs the NPU cost per extra sequence
  for a model this small. A full decode batch of 128 then steps in ~36 ms (~3600 tokens/s).
  `per_prefill_token` 40 us: a visual token costs the 675M NaViT encoder on 4 patches plus the
  decoder (~6 GFLOP) at ~150 TFLOPS effective; a 1036x1036 layout page (1369 visual tokens) takes
  ~55 ms of prefill. Text tokens are charged the same (they are few in MinerU prompts).
- `max_num_seqs` 128, `max_num_batched_tokens` 16384, `block_size` 128: the typical VLM flags on
  Atlas A2 (docs/vllm-ascend.md) and vLLM-Ascend's KV block size.
- `max_model_len` 16384: assumed MinerU2.5's context length as served by `mineru-vllm-server`.
- `kv_cache_tokens` 262144 (128 x 2048): chosen so a full batch of 128 layout requests (~1400
  prompt plus ~600 output tokens on average) approaches it, so KV pressure and preemption appear
  under layout-heavy load.
  A real 910B at MinerU's `--gpu-memory-utilization 0.5` would hold far more (~2M tokens at 12 KiB
  per token for Qwen2-0.5B's 24 layers x 2 KV heads x 64 dims in bf16); raise it to model that.
- `time_scale` multiplies every duration (10 = ten times slower, same shape) so that experiments fit
  a 2-core machine; `speed` divides step rates (0.5 = a worker at half speed). Latency metrics are
  wall seconds as clients see them, so they scale too.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Literal

from mineru_gateway.vllm_contract import DIALECTS, NEWEST_VERSION, SUPPORTED_VERSIONS, Dialect

SchedulingPolicy = Literal["fcfs", "priority"]

DEFAULT_MODEL_NAME = "opendatalab/MinerU2.5-2509-1.2B"


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated vLLM worker. See the module docstring for where each default comes from."""

    model_name: str = DEFAULT_MODEL_NAME
    max_model_len: int = 16384
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 16384
    kv_cache_tokens: int = 262_144
    block_size: int = 128
    step_base_s: float = 0.010
    step_per_seq_s: float = 0.0002
    step_per_prefill_token_s: float = 0.00004
    time_scale: float = 1.0
    speed: float = 1.0
    seed: int = 0
    scheduling_policy: SchedulingPolicy = "fcfs"
    enable_server_load_tracking: bool = False
    engine_label: str = "0"
    vllm_version: str = NEWEST_VERSION
    shutdown_timeout: float = 0.0
    api_server_count: int = 1
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "api_server_count",
        ):
            _require(getattr(self, name) >= 1, f"{name} must be at least 1")
        for name in ("time_scale", "speed"):
            _require(getattr(self, name) > 0, f"{name} must be positive")
        for name in ("step_base_s", "step_per_seq_s", "step_per_prefill_token_s"):
            _require(getattr(self, name) >= 0, f"{name} must not be negative")
        # vLLM refuses to start when one request of max_model_len cannot fit in the KV cache.
        _require(
            self.kv_cache_blocks * self.block_size >= self.max_model_len,
            f"kv_cache_tokens ({self.kv_cache_tokens}, in whole blocks of {self.block_size}) "
            f"must hold max_model_len ({self.max_model_len})",
        )
        _require(self.scheduling_policy in ("fcfs", "priority"), "unknown scheduling_policy")
        _require(
            self.vllm_version in DIALECTS,
            f"vllm_version must be one of {', '.join(SUPPORTED_VERSIONS)}",
        )
        dialect = self.dialect
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            limit = getattr(self, name)
            _require(limit is None or limit >= 0, f"{name} must not be negative")
            _require(
                limit is None or dialect.queue_limits,
                f"vLLM {self.vllm_version} has no --{name.replace('_', '-')}",
            )
        _require(
            self.shutdown_timeout == 0 or dialect.shutdown_timeout,
            f"vLLM {self.vllm_version} has no --shutdown-timeout (SIGTERM aborts at once)",
        )

    @property
    def dialect(self) -> Dialect:
        """What this vLLM version does differently (vllm_contract.py)."""
        return DIALECTS[self.vllm_version]

    @property
    def kv_cache_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


_HELP = {
    "model_name": "Served model name, the only id in /v1/models.",
    "max_model_len": "Longest prompt plus output, in tokens.",
    "max_num_seqs": "Largest running batch.",
    "max_num_batched_tokens": "Token budget of one step (chunked prefill).",
    "kv_cache_tokens": "KV cache capacity in tokens; past it, requests are preempted.",
    "block_size": "KV cache block size in tokens.",
    "step_base_s": "Fixed cost of one engine step, in simulated seconds.",
    "step_per_seq_s": "Step cost per scheduled sequence.",
    "step_per_prefill_token_s": "Step cost per prefilled prompt token.",
    "time_scale": "Multiplies every duration (10 runs ten times slower, same shape).",
    "speed": "Divides step rates (0.5 is a worker at half speed).",
    "seed": "Mixed into the per-request seed that draws answer lengths.",
    "scheduling_policy": "Waiting queue order: fcfs, or priority (vLLM's `priority` field).",
    "enable_server_load_tracking": "Serve GET /load like vLLM's flag of the same name.",
    "engine_label": "The `engine` label of the metrics.",
    "vllm_version": "The vLLM version whose dialect the simulator speaks (metric names, "
    "duplicate request ids, queue limits, shutdown): one of " + ", ".join(SUPPORTED_VERSIONS) + ".",
    "shutdown_timeout": "On SIGTERM, seconds in-flight requests may still finish before they "
    "are aborted; 0 aborts them at once (vLLM's --shutdown-timeout, default 0).",
    "api_server_count": "Only changes what a filtered /metrics/?name[]=... read answers: with "
    "more than one API server, vLLM's multiprocess Prometheus registry knows no names, and the "
    "filtered page is empty (docs/vllm.md).",
    "max_num_queued_reqs": "Refuse a request with vLLM's queue-full 503 when this many are "
    "already waiting or running (vLLM 0.29 and later; 0 refuses every request).",
    "max_num_queued_tokens": "Refuse a request with vLLM's 503 when the prompts still in prefill "
    "hold this many tokens (vLLM 0.29 and later).",
}


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one `--kebab-case` flag per `SimConfig` field (not --host/--port)."""
    defaults = SimConfig()
    for field in fields(SimConfig):
        flag = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        help_text = f"{_HELP[field.name]} (default: {default})"
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        elif field.name == "scheduling_policy":
            parser.add_argument(flag, choices=["fcfs", "priority"], help=help_text)
        elif field.name == "vllm_version":
            parser.add_argument(flag, choices=SUPPORTED_VERSIONS, help=help_text)
        elif default is None:  # a limit that is off unless given
            parser.add_argument(flag, type=int, help=help_text)
        else:
            parser.add_argument(flag, type=type(default), help=help_text)


def sim_config_from_args(ns: argparse.Namespace) -> SimConfig:
    """Builds a `SimConfig` from parsed flags; flags left out keep the defaults."""
    given = {
        field.name: getattr(ns, field.name)
        for field in fields(SimConfig)
        if getattr(ns, field.name, None) is not None
    }
    return SimConfig(**given)

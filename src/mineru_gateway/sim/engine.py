"""Continuous batching as vLLM's V1 scheduler does it, token by token, without a model.

Two layers:

- `Scheduler`, pure and synchronous. `schedule(now)` picks one step's work: running requests first
  (one token each when decoding, their next chunk when prefilling), then waiting ones while the
  batch (`max_num_seqs`), the step's token budget (`max_num_batched_tokens`) and the KV blocks
  allow. When a running request needs a block and none is free, the newest running request (or the
  lowest-priority one) is preempted: its blocks are freed and it waits again at the queue's head, to
  recompute prompt and output so far. `step_cost(plan)` prices the step in simulated seconds and
  `commit(plan, now)` applies it when the step ends. Tests drive it with simulated time.
- `EngineLoop`, one asyncio task running steps back to back: it sleeps each step's cost times
  `time_scale`, then wakes the HTTP handlers of the requests that got a token.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import itertools
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from mineru_gateway.sim.config import SimConfig
from mineru_gateway.sim.stats import EngineStats


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request inside the engine. `output_tokens` is decided on arrival."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    max_tokens: int
    priority: int = 0
    state: RequestState = RequestState.WAITING
    arrival: float = 0.0
    order: int = 0
    computed: int = 0
    generated: int = 0
    blocks: int = 0
    preemptions: int = 0
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float = 0.0
    waiter: asyncio.Future[None] | None = None

    @property
    def done(self) -> bool:
        return self.state is RequestState.FINISHED or self.state is RequestState.ABORTED

    @property
    def known_tokens(self) -> int:
        return self.prompt_tokens + self.generated

    async def changed(self) -> None:
        """Returns once the engine gave this request a token, finished or aborted it."""
        self.waiter = asyncio.get_running_loop().create_future()
        await self.waiter

    def wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


@dataclass(slots=True)
class StepPlan:
    """One step's work: tokens to compute per request."""

    work: dict[SimRequest, int] = field(default_factory=dict)
    budget: int = 0
    decode_seqs: int = 0
    total_tokens: int = 0
    preempted: bool = False

    @property
    def empty(self) -> bool:
        return not self.work

    @property
    def prefill_tokens(self) -> int:
        return self.total_tokens - self.decode_seqs

    def add(self, request: SimRequest, tokens: int) -> None:
        self.work[request] = tokens
        self.budget -= tokens
        self.total_tokens += tokens
        self.decode_seqs += _is_decode(request, tokens)

    def drop(self, request: SimRequest) -> None:
        tokens = self.work.pop(request, None)
        if tokens is not None:
            self.budget += tokens
            self.total_tokens -= tokens
            self.decode_seqs -= _is_decode(request, tokens)


def _is_decode(request: SimRequest, tokens: int) -> bool:
    return tokens == 1 and request.generated > 0 and request.computed + 1 == request.known_tokens


class Scheduler:
    """The engine's state and scheduling policy; see the module docstring."""

    def __init__(self, config: SimConfig, stats: EngineStats | None = None) -> None:
        self.config = config
        self.stats = stats if stats is not None else EngineStats()
        self.speed = config.speed
        self.running: list[SimRequest] = []
        self.waiting: list[SimRequest] = []
        self.total_blocks = config.kv_cache_blocks
        self.free_blocks = self.total_blocks
        self._orders = itertools.count()
        self._by_priority = config.scheduling_policy == "priority"

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks

    @property
    def unfinished(self) -> int:
        """Requests waiting or running: what vLLM's `--max-num-queued-reqs` counts."""
        return len(self.running) + len(self.waiting)

    @property
    def queued_prompt_tokens(self) -> int:
        """Prompt tokens of the requests still in prefill, whole (as vLLM counts them for
        `--max-num-queued-tokens`)."""
        queued = sum(r.prompt_tokens for r in self.waiting)
        return queued + sum(r.prompt_tokens for r in self.running if r.computed < r.prompt_tokens)

    def add(self, request: SimRequest, now: float) -> None:
        request.arrival = now
        request.order = next(self._orders)
        request.state = RequestState.WAITING
        self.stats.arrived += 1
        self._enqueue(request, front=False)

    def abort(self, request: SimRequest) -> bool:
        """Drops a request wherever it is; False if it had already ended."""
        if request.done:
            return False
        if request.state is RequestState.RUNNING:
            self.running.remove(request)
            self._free(request)
        else:
            self.waiting.remove(request)
        request.state = RequestState.ABORTED
        self.stats.aborted += 1
        return True

    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan(budget=self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        # As vLLM: a step that had to preempt admits nobody new.
        if not plan.preempted:
            self._admit_waiting(plan, now)
        return plan

    def step_cost(self, plan: StepPlan) -> float:
        if plan.empty:
            return 0.0
        config = self.config
        cost = (
            config.step_base_s
            + config.step_per_seq_s * len(plan.work)
            + config.step_per_prefill_token_s * plan.prefill_tokens
        )
        return cost / self.speed

    def commit(self, plan: StepPlan, now: float) -> list[SimRequest]:
        """Applies a step ending at `now`; returns the requests that got a token."""
        self.stats.steps += 1
        self.stats.iteration_tokens.observe(plan.total_tokens)
        sampled: list[SimRequest] = []
        gaps: dict[float, int] = {}
        for request, tokens in plan.work.items():
            if request.state is not RequestState.RUNNING:
                continue  # aborted while the step ran
            request.computed += tokens
            if request.computed == request.known_tokens:
                self._sample(request, now, gaps)
                sampled.append(request)
        for last, count in gaps.items():
            self.stats.itl.observe(now - last, count)
        self.stats.generation_tokens += len(sampled)
        if any(request.state is RequestState.FINISHED for request in sampled):
            self.running = [r for r in self.running if r.state is RequestState.RUNNING]
        return sampled

    def _schedule_running(self, plan: StepPlan) -> None:
        for request in list(self.running):
            if plan.budget <= 0:
                return
            if request.state is RequestState.RUNNING:  # else preempted earlier in this loop
                tokens = min(request.known_tokens - request.computed, plan.budget)
                self._reserve(request, tokens, plan)

    def _reserve(self, request: SimRequest, tokens: int, plan: StepPlan) -> None:
        while not self._allocate(request, request.computed + tokens):
            victim = self._victim()
            self._preempt(victim, plan)
            if victim is request:
                return
        plan.add(request, tokens)

    def _admit_waiting(self, plan: StepPlan, now: float) -> None:
        while self.waiting and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            tokens = min(request.known_tokens - request.computed, plan.budget)
            if not self._allocate(request, tokens):
                return
            del self.waiting[0]
            request.state = RequestState.RUNNING
            if request.scheduled_at is None:
                request.scheduled_at = now
            self.running.append(request)
            plan.add(request, tokens)

    def _sample(self, request: SimRequest, now: float, gaps: dict[float, int]) -> None:
        request.generated += 1
        if request.first_token_at is None:
            request.first_token_at = now
            self.stats.ttft.observe(now - request.arrival)
            self.stats.prompt_tokens += request.prompt_tokens
        else:
            gaps[request.last_token_at] = gaps.get(request.last_token_at, 0) + 1
        request.last_token_at = now
        if request.generated >= request.output_tokens:
            self._finish(request, now)

    def _finish(self, request: SimRequest, now: float) -> None:
        request.state = RequestState.FINISHED
        self._free(request)
        scheduled = request.scheduled_at if request.scheduled_at is not None else now
        first_token = request.first_token_at if request.first_token_at is not None else now
        stats = self.stats
        stats.finished[request.finish_reason] += 1
        stats.e2e.observe(now - request.arrival)
        stats.queue.observe(scheduled - request.arrival)
        stats.inference.observe(now - scheduled)
        stats.prefill.observe(first_token - scheduled)
        stats.decode.observe(now - first_token)
        if request.generated > 1:
            stats.tpot.observe((now - first_token) / (request.generated - 1))
        stats.prompt_len.observe(request.prompt_tokens)
        stats.prefill_computed.observe(request.prompt_tokens)
        stats.generation_len.observe(request.generated)
        stats.max_tokens_param.observe(request.max_tokens)
        stats.max_generation.observe(request.max_tokens)
        stats.n_param.observe(1)
        stats.request_preemptions.observe(request.preemptions)

    def _allocate(self, request: SimRequest, tokens: int) -> bool:
        needed = -(-tokens // self.config.block_size) - request.blocks
        if needed > self.free_blocks:
            return False
        if needed > 0:
            self.free_blocks -= needed
            request.blocks += needed
        return True

    def _free(self, request: SimRequest) -> None:
        self.free_blocks += request.blocks
        request.blocks = 0

    def _victim(self) -> SimRequest:
        if self._by_priority:
            return max(self.running, key=_priority_key)
        return self.running[-1]

    def _preempt(self, request: SimRequest, plan: StepPlan) -> None:
        plan.drop(request)
        plan.preempted = True
        self.running.remove(request)
        self._free(request)
        request.computed = 0
        request.preemptions += 1
        self.stats.preemptions += 1
        request.state = RequestState.WAITING
        self._enqueue(request, front=True)

    def _enqueue(self, request: SimRequest, front: bool) -> None:
        if self._by_priority:
            bisect.insort(self.waiting, request, key=_priority_key)
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)


def _priority_key(request: SimRequest) -> tuple[int, int]:
    return request.priority, request.order


Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


class EngineLoop:
    """Runs a `Scheduler` in real (scaled) time on the current event loop."""

    def __init__(
        self,
        scheduler: Scheduler,
        time_scale: float,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.scheduler = scheduler
        self.time_scale = time_scale
        self.clock = clock
        self._sleep = sleep
        self._work_arrived = asyncio.Event()
        self._next_step_at = 0.0
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        self._work_arrived = asyncio.Event()  # bound to the loop that runs the engine
        self._task = asyncio.get_running_loop().create_task(self.run(), name="sim-engine")
        if self.scheduler.has_work:
            self._work_arrived.set()

    async def stop(self) -> None:
        """Stops stepping and aborts every request still inside, waking their handlers."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            self.abort(request)

    def submit(self, request: SimRequest) -> None:
        self.scheduler.add(request, self.clock())
        self._work_arrived.set()

    def abort(self, request: SimRequest) -> None:
        if self.scheduler.abort(request):
            request.wake()

    async def run(self) -> None:
        while True:
            plan = self.scheduler.schedule(self.clock())
            if plan.empty:
                await self._idle()
                continue
            await self._pace(self.scheduler.step_cost(plan) * self.time_scale)
            _wake_all(self.scheduler.commit(plan, self.clock()))

    async def _idle(self) -> None:
        self._work_arrived.clear()
        await self._work_arrived.wait()
        self._next_step_at = self.clock()

    async def _pace(self, duration: float) -> None:
        # Steps end on a schedule rather than after each sleep, so timer slack does not add up;
        # when the loop runs late it catches up by at most one step.
        now = self.clock()
        start = max(self._next_step_at, now - duration)
        self._next_step_at = start + duration
        await self._sleep(max(0.0, self._next_step_at - now))


def _wake_all(requests: Iterable[SimRequest]) -> None:
    for request in requests:
        request.wake()

"""The scheduler in simulated time: no HTTP, no wall clock."""

import asyncio
import dataclasses
import random

import pytest

from mineru_gateway.prompts import PromptKind
from mineru_gateway.sim import workload
from mineru_gateway.sim.config import SimConfig
from mineru_gateway.sim.engine import EngineLoop, RequestState, Scheduler, SimRequest

pytestmark = pytest.mark.unit

SMALL = SimConfig(
    max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=1024, kv_cache_tokens=65536
)


def make_request(prompt: int = 100, output: int = 10, priority: int = 0) -> SimRequest:
    return SimRequest(
        request_id=f"r{prompt}-{output}",
        prompt_tokens=prompt,
        output_tokens=output,
        finish_reason="stop",
        max_tokens=output + 1,
        priority=priority,
    )


def step(scheduler: Scheduler, now: float) -> float:
    plan = scheduler.schedule(now)
    now += scheduler.step_cost(plan)
    scheduler.commit(plan, now)
    return now


def run_until_idle(scheduler: Scheduler, now: float = 0.0, max_steps: int = 200_000) -> float:
    for _ in range(max_steps):
        if not scheduler.has_work:
            return now
        now = step(scheduler, now)
    raise AssertionError("the scheduler did not drain")


def test_requests_beyond_max_num_seqs_wait() -> None:
    scheduler = Scheduler(SMALL)
    requests = [make_request() for _ in range(10)]
    for request in requests:
        scheduler.add(request, 0.0)
    step(scheduler, 0.0)
    assert (len(scheduler.running), len(scheduler.waiting)) == (4, 6)
    run_until_idle(scheduler)
    assert all(r.state is RequestState.FINISHED and r.generated == 10 for r in requests)
    assert scheduler.stats.finished["stop"] == 10
    assert scheduler.stats.queue.total > 0


def test_step_cost_grows_with_batch_and_prefill_tokens() -> None:
    def decode_cost(batch: int) -> float:
        scheduler = Scheduler(dataclasses.replace(SMALL, max_num_seqs=64))
        for _ in range(batch):
            scheduler.add(make_request(prompt=10, output=5), 0.0)
        step(scheduler, 0.0)  # prefill
        return scheduler.step_cost(scheduler.schedule(1.0))

    assert decode_cost(1) < decode_cost(8) < decode_cost(32)
    assert decode_cost(32) - decode_cost(1) == pytest.approx(31 * SMALL.step_per_seq_s)

    scheduler = Scheduler(SMALL)
    scheduler.add(make_request(prompt=800), 0.0)
    plan = scheduler.schedule(0.0)
    assert plan.prefill_tokens == 800
    expected = SMALL.step_base_s + SMALL.step_per_seq_s + 800 * SMALL.step_per_prefill_token_s
    assert scheduler.step_cost(plan) == pytest.approx(expected)


def test_inter_token_latency_grows_with_batch() -> None:
    def mean_itl(batch: int) -> float:
        scheduler = Scheduler(dataclasses.replace(SMALL, max_num_seqs=128))
        for _ in range(batch):
            scheduler.add(make_request(prompt=10, output=50), 0.0)
        run_until_idle(scheduler)
        itl = scheduler.stats.itl
        assert itl.count == batch * 49
        return itl.total / itl.count

    assert mean_itl(1) < mean_itl(16) < mean_itl(128)


def test_chunked_prefill_respects_the_token_budget() -> None:
    scheduler = Scheduler(dataclasses.replace(SMALL, max_num_batched_tokens=512))
    decoding = make_request(prompt=10, output=100)
    scheduler.add(decoding, 0.0)
    now = step(scheduler, 0.0)
    long_prompt = make_request(prompt=1500, output=5)
    scheduler.add(long_prompt, now)
    steps_to_first_token = 0
    while long_prompt.generated == 0:
        plan = scheduler.schedule(now)
        assert plan.total_tokens <= 512
        assert plan.work[decoding] == 1  # decodes go first, every step
        now += scheduler.step_cost(plan)
        scheduler.commit(plan, now)
        steps_to_first_token += 1
    assert steps_to_first_token == 3  # 511 + 511 + 478 prompt tokens


def test_kv_cache_usage_and_preemption() -> None:
    config = SimConfig(
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=4096,
        kv_cache_tokens=2048,
        block_size=16,
    )
    scheduler = Scheduler(config)
    requests = [make_request(prompt=200, output=500) for _ in range(4)]
    for request in requests:
        scheduler.add(request, 0.0)
    now = step(scheduler, 0.0)
    assert scheduler.kv_usage == pytest.approx(4 * 13 * 16 / 2048)
    peak = 0.0
    while scheduler.has_work:
        now = step(scheduler, now)
        peak = max(peak, scheduler.kv_usage)
    assert scheduler.stats.preemptions > 0
    assert peak > 0.9
    assert all(r.generated == 500 and r.state is RequestState.FINISHED for r in requests)
    assert scheduler.stats.generation_tokens == 4 * 500
    assert scheduler.kv_usage == 0.0
    assert scheduler.stats.request_preemptions.total == scheduler.stats.preemptions


def test_abort_frees_the_slot_and_the_kv_cache() -> None:
    scheduler = Scheduler(dataclasses.replace(SMALL, max_num_seqs=1))
    first, second = make_request(output=1000), make_request(output=3)
    scheduler.add(first, 0.0)
    scheduler.add(second, 0.0)
    now = step(scheduler, 0.0)
    assert scheduler.running == [first] and scheduler.kv_usage > 0
    assert scheduler.abort(first)
    assert not scheduler.abort(first)
    assert scheduler.kv_usage == 0.0 and scheduler.running == []
    run_until_idle(scheduler, now)
    assert second.state is RequestState.FINISHED
    stats = scheduler.stats
    assert (stats.aborted, stats.completed, stats.e2e.count) == (1, 1, 1)


def test_abort_while_waiting_and_during_a_step() -> None:
    scheduler = Scheduler(dataclasses.replace(SMALL, max_num_seqs=1))
    running, waiting = make_request(output=5), make_request(output=5)
    scheduler.add(running, 0.0)
    scheduler.add(waiting, 0.0)
    plan = scheduler.schedule(0.0)
    scheduler.abort(waiting)
    scheduler.abort(running)  # mid-step: the commit must skip it
    assert scheduler.commit(plan, 1.0) == []
    assert running.generated == 0 and not scheduler.has_work
    assert scheduler.stats.aborted == 2


def test_priority_policy_admits_the_most_urgent_first() -> None:
    config = dataclasses.replace(SMALL, max_num_seqs=1, scheduling_policy="priority")
    scheduler = Scheduler(config)
    low, high = make_request(priority=5), make_request(priority=-1)
    scheduler.add(make_request(output=2), 0.0)
    step(scheduler, 0.0)
    scheduler.add(low, 0.0)
    scheduler.add(high, 0.0)
    assert scheduler.waiting == [high, low]
    run_until_idle(scheduler)
    assert high.scheduled_at is not None and low.scheduled_at is not None
    assert high.scheduled_at < low.scheduled_at


def test_priority_policy_preempts_the_least_urgent() -> None:
    config = SimConfig(
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=4096,
        kv_cache_tokens=512,
        block_size=16,
        scheduling_policy="priority",
    )
    scheduler = Scheduler(config)
    urgent, casual = (
        make_request(prompt=100, output=300, priority=0),
        make_request(prompt=100, output=300, priority=9),
    )
    scheduler.add(casual, 0.0)
    scheduler.add(urgent, 0.0)
    run_until_idle(scheduler)
    assert casual.preemptions > 0 and urgent.preemptions == 0
    assert urgent.generated == casual.generated == 300


def test_an_empty_step_costs_nothing() -> None:
    scheduler = Scheduler(SMALL)
    plan = scheduler.schedule(0.0)
    assert plan.empty and scheduler.step_cost(plan) == 0.0


def test_speed_divides_the_step_rate() -> None:
    full, half = Scheduler(SMALL), Scheduler(dataclasses.replace(SMALL, speed=0.5))
    for scheduler in (full, half):
        scheduler.add(make_request(prompt=300, output=40), 0.0)
    assert run_until_idle(half) == pytest.approx(2 * run_until_idle(full))


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        self.now += delay
        await asyncio.sleep(0)


async def run_loop(time_scale: float, requests: list[SimRequest]) -> tuple[Scheduler, FakeTime]:
    fake = FakeTime()
    scheduler = Scheduler(SMALL)
    engine = EngineLoop(scheduler, time_scale, clock=fake.clock, sleep=fake.sleep)
    engine.start()
    for request in requests:
        engine.submit(request)
    for request in requests:
        while not request.done:
            await request.changed()
    await engine.stop()
    return scheduler, fake


def workload_requests() -> list[SimRequest]:
    return [make_request(prompt=50 * (i + 1), output=5 + 7 * i) for i in range(9)]


async def test_time_scale_stretches_every_duration_alike() -> None:
    base, base_time = await run_loop(1.0, workload_requests())
    slow, slow_time = await run_loop(10.0, workload_requests())
    assert slow_time.now == pytest.approx(10 * base_time.now)
    assert slow_time.sleeps == pytest.approx([10 * d for d in base_time.sleeps])
    for name in ("ttft", "itl", "e2e", "queue"):
        fast_hist, slow_hist = getattr(base.stats, name), getattr(slow.stats, name)
        assert slow_hist.count == fast_hist.count
        assert slow_hist.total == pytest.approx(10 * fast_hist.total)
    assert slow.stats.steps == base.stats.steps


async def test_engine_loop_wakes_waiters_and_stop_aborts_the_rest() -> None:
    fake = FakeTime()
    scheduler = Scheduler(SMALL)
    engine = EngineLoop(scheduler, 1.0, clock=fake.clock, sleep=fake.sleep)
    engine.start()
    short, endless = make_request(output=3), make_request(output=10**6)
    engine.submit(short)
    engine.submit(endless)
    seen = []
    while not short.done:
        await short.changed()
        seen.append(short.generated)
    assert seen == [1, 2, 3]
    waiter = asyncio.ensure_future(endless.changed())
    await engine.stop()
    await asyncio.wait_for(waiter, 1.0)
    assert endless.state is RequestState.ABORTED and not scheduler.has_work
    assert not engine.running


BLOCKS_PER_PAGE = [(PromptKind.TEXT, 90)] * 10 + [(PromptKind.FORMULA, 74)] * 2
TABLE_BLOCK = (PromptKind.TABLE, 438)
LAYOUT_PROMPT = 1369 + 2 + 30  # a 1036x1036 page plus the chat template and prompt


class PageLoop:
    """MinerU's client in a closed loop: each page is one layout request, then its blocks at once
    (ten text lines, two formulas, a table on 30% of pages), `concurrency` pages in flight."""

    def __init__(self, scheduler: Scheduler, pages: int, concurrency: int) -> None:
        self.scheduler = scheduler
        self.rng = random.Random(7)
        self.now = 0.0
        self.pages_left = pages
        self.pages_done = 0
        self.page_of: dict[SimRequest, int] = {}
        self.blocks_left: dict[int, int] = {}
        for _ in range(concurrency):
            self.start_page()

    def submit(self, kind: PromptKind, prompt: int, page: int) -> None:
        drawn = workload.draw_length(kind, self.rng.getrandbits(32))
        answer = workload.plan_answer(drawn, 4096, 0, False)
        request = SimRequest("r", prompt, answer.tokens, answer.finish_reason, 4096)
        self.scheduler.add(request, self.now)
        self.page_of[request] = page

    def start_page(self) -> None:
        self.pages_left -= 1
        self.submit(PromptKind.LAYOUT, LAYOUT_PROMPT, self.pages_left)

    def on_done(self, page: int) -> None:
        if page not in self.blocks_left:
            blocks = BLOCKS_PER_PAGE + ([TABLE_BLOCK] if self.rng.random() < 0.3 else [])
            self.blocks_left[page] = len(blocks)
            for kind, prompt in blocks:
                self.submit(kind, prompt, page)
            return
        self.blocks_left[page] -= 1
        if self.blocks_left[page] == 0:
            self.pages_done += 1
            if self.pages_left > 0:
                self.start_page()

    def run(self) -> None:
        while self.scheduler.has_work:
            self.now = step(self.scheduler, self.now)
            for request in [r for r in self.page_of if r.done]:
                self.on_done(self.page_of.pop(request))


def test_defaults_match_the_mineru_paper_throughput_anchor() -> None:
    """MinerU2.5 on one A100: 2.12 pages/s, 2337 output tokens/s; a 910B is assumed alike."""
    pages = PageLoop(Scheduler(SimConfig()), pages=400, concurrency=128)
    pages.run()
    assert pages.pages_done == 400
    assert 1.7 <= pages.pages_done / pages.now <= 2.6
    assert 2000 <= pages.scheduler.stats.generation_tokens / pages.now <= 3000


def test_a_full_batch_of_layout_requests_fills_the_kv_cache() -> None:
    scheduler = Scheduler(SimConfig())
    for seed in range(256):
        drawn = workload.draw_length(PromptKind.LAYOUT, seed)
        scheduler.add(SimRequest("r", LAYOUT_PROMPT, drawn, "stop", 4096), 0.0)
    now, peak = 0.0, 0.0
    while scheduler.has_work:
        now = step(scheduler, now)
        peak = max(peak, scheduler.kv_usage)
    assert peak > 0.8

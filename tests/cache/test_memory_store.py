"""The in-process cache: bounded in bytes, a tenant's share bounded, answers expire."""

from __future__ import annotations

import tracemalloc

import pytest

from mineru_gateway.cache.answers import Answer
from mineru_gateway.cache.metrics import CacheMetrics
from mineru_gateway.cache.stores import MemoryStore

pytestmark = pytest.mark.unit


def answer(size: int) -> Answer:
    return Answer(200, "application/json", b"x" * size)


def key(number: int) -> bytes:
    return number.to_bytes(32, "big")


def test_the_cache_stays_under_its_byte_bound_evicting_the_least_recently_used() -> None:
    metrics = CacheMetrics()
    store = MemoryStore(10_000, 10_000, 60.0, metrics)
    one = answer(1000)  # with what it costs beyond its body
    fit = 10_000 // one.size
    for number in range(fit):
        store.keep(key(number), "t", one)
    assert store.lookup(key(0)) is not None  # used: kept over 1
    store.keep(key(fit), "t", one)
    assert store.lookup(key(0)) is not None and store.lookup(key(1)) is None
    for number in range(fit + 1, 100):
        store.keep(key(number), "t", one)
        assert store.total <= 10_000
    assert store.lookup(key(99)) is not None
    assert metrics.evictions.cell("t")[0] == 100 - store.total // one.size


def test_one_tenant_filling_the_cache_evicts_its_own_answers_not_the_others() -> None:
    store = MemoryStore(10_000, 5_000, 60.0, CacheMetrics())
    store.keep(key(0), "small", answer(1000))
    store.keep(key(1), "other", answer(1000))
    for number in range(100, 200):
        store.keep(key(number), "flood", answer(1000))
    assert store.held()["flood"] <= 5_000
    assert store.lookup(key(0)) is not None and store.lookup(key(1)) is not None
    # The whole cache full: the tenant holding the most gives way.
    store.keep(key(2), "other", answer(1000))
    store.keep(key(3), "small", answer(1000))
    assert store.total <= 10_000
    assert store.lookup(key(0)) is not None and store.lookup(key(2)) is not None


def test_an_answer_larger_than_a_tenants_share_is_not_kept_and_answers_expire() -> None:
    now = [0.0]
    store = MemoryStore(10_000, 2_000, 5.0, CacheMetrics(), clock=lambda: now[0])
    store.keep(key(0), "t", answer(3_000))
    assert store.lookup(key(0)) is None and store.total == 0
    store.keep(key(1), "t", answer(10))
    now[0] = 4.9
    assert store.lookup(key(1)) is not None
    now[0] = 5.0
    assert store.lookup(key(1)) is None and store.total == 0 and store.held() == {}


def test_an_entrys_counted_size_covers_the_memory_it_takes() -> None:
    """The bound is on counted sizes: each must cover what the entry really holds (its body,
    key, answer and the store's records), or the process would outgrow the bound."""
    store = MemoryStore(1 << 40, 1 << 40, 60.0, CacheMetrics())
    count = 5000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for number in range(count):
            body = number.to_bytes(4, "big") * 300  # 1,200 bytes, made inside the measure
            store.keep(key(number), "t", Answer(200, "application/json", body, 0.5))
        taken = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.total == count * answer(1200).size
    assert taken <= store.total

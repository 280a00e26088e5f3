"""The fair queue and the room policy: pure code, tested without servers."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator

import pytest

from mineru_gateway.flow import (
    DrainRate,
    FairQueue,
    KeptTurns,
    QueueLimits,
    Rejected,
    RoomPolicy,
    TenantPolicy,
    Ticket,
)
from mineru_gateway.prompts import PromptKind
from mineru_gateway.routing import LoadModel, ReportedLoad, WorkerView

pytestmark = pytest.mark.unit

A, B, C = TenantPolicy("a"), TenantPolicy("b"), TenantPolicy("c")


def ticket(
    tenant: TenantPolicy,
    *,
    priority: int = 0,
    cost: float = 1.0,
    size: int = 1,
    flow: str | None = None,
    kind: PromptKind = PromptKind.OTHER,
) -> Ticket:
    return Ticket(tenant, priority, cost, size, enqueued_at=0.0, flow=flow, kind=kind)


def drain(queue: FairQueue, count: int | None = None) -> Iterator[Ticket]:
    """Serves up to `count` tickets in the queue's order (each finishes at once)."""
    served = 0
    while (count is None or served < count) and (head := queue.next()) is not None:
        queue.pop(head)
        queue.done(head)
        served += 1
        yield head


def test_a_small_tenant_is_served_next_however_much_another_has_queued() -> None:
    queue = FairQueue()
    for _ in range(1500):
        queue.push(ticket(A))
    list(drain(queue, 10))
    latecomer = ticket(B)
    queue.push(latecomer)
    assert queue.next() is latecomer


def test_backlogged_tenants_share_in_proportion_to_their_weights() -> None:
    queue = FairQueue()
    heavy, light = TenantPolicy("heavy", weight=3.0), TenantPolicy("light", weight=1.0)
    for _ in range(400):
        queue.push(ticket(heavy))
        queue.push(ticket(light))
    served = Counter(t.name for t in drain(queue, 400))
    assert served["heavy"] == pytest.approx(300, abs=2)
    assert served["light"] == pytest.approx(100, abs=2)


def test_fair_sharing_is_on_cost_not_request_counts() -> None:
    """A tenant sending pages (cost 3) gets a third of the requests of one sending blocks."""
    queue = FairQueue()
    pages, blocks = TenantPolicy("pages"), TenantPolicy("blocks")
    for _ in range(300):
        queue.push(ticket(pages, cost=3.0))
        queue.push(ticket(blocks, cost=1.0))
    served = Counter(t.name for t in drain(queue, 200))
    assert served["blocks"] == pytest.approx(3 * served["pages"], abs=3)


def test_fifo_within_a_tenant() -> None:
    queue = FairQueue()
    pushed = [ticket(A) for _ in range(5)]
    for item in pushed:
        queue.push(item)
    assert list(drain(queue)) == pushed


@pytest.mark.parametrize(
    ("priorities", "expected"),
    [
        ([0, -1, 5, 0], [-1, 0, 0, 5]),  # lower first, as vLLM orders its queue
        ([3, 3, 1], [1, 3, 3]),
    ],
)
def test_priority_bands_are_strict(priorities: list[int], expected: list[int]) -> None:
    queue = FairQueue()
    for index, priority in enumerate(priorities):
        queue.push(ticket(TenantPolicy(f"t{index}"), priority=priority))
    assert [t.priority for t in drain(queue)] == expected


@pytest.mark.parametrize(
    ("tenant", "asked", "effective"),
    [
        (TenantPolicy("x"), None, 0),
        (TenantPolicy("x"), 5, 5),  # background work: allowed
        (TenantPolicy("x"), -3, 0),  # jumping ahead of others: not by default
        (TenantPolicy("x", priority=2), None, 2),
        (TenantPolicy("x", priority=2, min_priority=-1), -3, -1),
    ],
)
def test_effective_priority(tenant: TenantPolicy, asked: int | None, effective: int) -> None:
    assert tenant.effective_priority(asked) == effective


def test_a_tenant_at_its_in_flight_limit_waits_while_others_go() -> None:
    queue = FairQueue()
    capped = TenantPolicy("capped", max_in_flight=2)
    for _ in range(5):
        queue.push(ticket(capped))
    queue.push(ticket(B))
    started = []
    while (head := queue.next()) is not None:
        queue.pop(head)
        started.append(head.name)
    assert Counter(started) == {"capped": 2, "b": 1}
    queue.done(ticket(capped))  # one of capped's requests ends
    head = queue.next()
    assert head is not None and head.name == "capped"


class OtherReplicas:
    """Fixed counts of each tenant elsewhere, as fleet state reads them from Redis."""

    def __init__(self, counts: dict[str, tuple[int, int, int]]) -> None:
        self.counts = counts

    def others(self, tenant: str) -> tuple[int, int, int]:
        return self.counts.get(tenant, (0, 0, 0))

    def publish(self, tenant: str, in_flight: int, queued: int, queued_bytes: int) -> None:
        pass


def test_in_flight_elsewhere_orders_by_share_but_limits_on_its_own_counts() -> None:
    """Fleet state: other replicas' requests in flight rank a tenant's share, while its
    `max_in_flight` is held by Redis's slots, not by their counts."""
    capped = TenantPolicy("capped", max_in_flight=2)
    queue = FairQueue(elsewhere=OtherReplicas({"capped": (5, 0, 0), "b": (1, 0, 0)}))
    queue.push(ticket(capped))
    queue.push(ticket(B))
    assert queue.may_start(capped)
    served = [head.name for head in drain(queue)]
    assert served == ["b", "capped"]  # b holds less of the fleet; capped is not held back


def test_a_tenants_queue_limits_count_other_replicas() -> None:
    small = TenantPolicy("small", max_queued=3, max_queued_bytes=100)
    elsewhere = OtherReplicas({"small": (0, 2, 80)})
    queue = FairQueue(elsewhere=elsewhere)
    with pytest.raises(Rejected) as too_big:
        queue.push(ticket(small, size=21))
    assert too_big.value.why == "tenant_queue_bytes_full"
    queue.push(ticket(small, size=20))
    with pytest.raises(Rejected) as full:
        queue.push(ticket(small, size=1))
    assert full.value.why == "tenant_queue_full"
    assert "3 requests queued" in str(full.value)
    elsewhere.counts["small"] = (0, 1, 40)  # room again, in another replica
    queue.push(ticket(small, size=1))


def test_shares_count_other_replicas() -> None:
    """With other replicas' counts the share goes first, then the tag: a tenant holding more
    of the fleet's requests for its weight waits behind one holding fewer."""
    queue = FairQueue(elsewhere=OtherReplicas({"a": (3, 0, 0)}))
    queue.push(ticket(A))
    queue.push(ticket(B))
    head = queue.next()
    assert head is not None and head.name == "b"
    # b is served, its tag moves on, and b still goes before a, which holds three requests
    # to b's one.
    queue.pop(head)
    queue.push(ticket(B))
    head = queue.next()
    assert head is not None and head.name == "b"
    alone = FairQueue()
    alone.push(ticket(A))
    alone.push(ticket(B))
    head = alone.next()
    assert head is not None and head.name == "a"  # first come, with nothing in flight


def test_a_tenant_limit_rejects_its_own_requests_only() -> None:
    queue = FairQueue()
    small = TenantPolicy("small", max_queued=2, max_queued_bytes=100)
    queue.push(ticket(small))
    queue.push(ticket(small))
    with pytest.raises(Rejected) as rejected:
        queue.push(ticket(small))
    assert rejected.value.why == "tenant_queue_full"
    with pytest.raises(Rejected) as too_big:
        queue.push(ticket(TenantPolicy("other", max_queued_bytes=10), size=11))
    assert too_big.value.why == "tenant_queue_bytes_full"
    queue.push(ticket(B))
    assert len(queue) == 3


def test_a_full_queue_sheds_the_newest_request_of_the_tenant_holding_most_of_it() -> None:
    queue = FairQueue(QueueLimits(max_queued=10))
    flood = [ticket(A) for _ in range(10)]
    for item in flood:
        assert queue.push(item) == []
    newcomer = ticket(B)
    assert queue.push(newcomer) == [flood[-1]]
    assert newcomer.queued and not flood[-1].queued
    # A flooding tenant's own newest request is the one to go:
    extra = ticket(A)
    assert queue.push(extra) == [extra]
    assert len(queue) == 10


def back(refused: Ticket) -> Ticket:
    """`refused` sent again, on the turn its refusal kept (flow.py's KeptTurns)."""
    again = ticket(refused.tenant, size=refused.size)
    again.first_seq = refused.seq
    return again


def test_a_full_queue_sheds_what_came_first_most_recently() -> None:
    queue = FairQueue(QueueLimits(max_queued=2))
    a, b, late = ticket(A), ticket(A, kind=PromptKind.TEXT), ticket(A)
    queue.push(a)
    queue.push(b)
    assert queue.push(late) == [late]  # refused: it came last
    assert list(drain(queue, 1)) == [b]  # block requests first (ordered steps)
    meanwhile = ticket(A)  # takes the place as soon as it is free
    assert queue.push(meanwhile) == []
    returning = back(late)
    assert queue.push(returning) == [meanwhile]  # `late` came first: `meanwhile` goes
    assert meanwhile.shed_why == "queue_full" and returning.queued
    # Back again: the newest, but nothing that came after it first is left to push out, so
    # it waits past the limit (up to twice it) rather than being refused on its turn.
    again = back(meanwhile)
    assert queue.push(again) == [] and len(queue) == 3
    newcomer = ticket(A)
    assert queue.push(newcomer) == [newcomer]
    assert [item.seq for item in queue.tickets()] == [a.seq, late.seq, meanwhile.seq]
    queue.push(extra := ticket(A))
    assert queue.push(back(extra)) == []
    assert len(queue) == 4  # twice the limit, all returning
    assert queue.push(late_again := ticket(A)) == [late_again]
    assert queue.push(last := back(late_again)) == [last]


def test_a_returning_request_takes_a_later_ones_place_under_its_tenants_limit() -> None:
    small = TenantPolicy("small", max_queued=2)
    queue = FairQueue()
    first, second = ticket(small), ticket(small)
    queue.push(first)
    queue.push(second)
    with pytest.raises(Rejected) as full:
        queue.push(late := ticket(small))
    assert full.value.why == "tenant_queue_full"
    list(drain(queue, 1))
    queue.push(meanwhile := ticket(small))
    assert queue.push(back(late)) == [meanwhile]
    assert meanwhile.shed_why == "tenant_queue_full"
    assert queue.push(back(meanwhile)) == []  # the newest: it waits, past the limit
    assert queue.queued_of("small") == 3
    with pytest.raises(Rejected):
        queue.push(refused := ticket(small))
    assert queue.push(back(refused)) == []
    with pytest.raises(Rejected):
        queue.push(again := ticket(small))
    with pytest.raises(Rejected) as twice:  # twice the limit is as far as returning ones go
        queue.push(back(again))
    assert twice.value.why == "tenant_queue_full" and queue.queued_of("small") == 4
    # Past the limit, a returning request still takes the place of one that came after it.
    queue = FairQueue()
    queue.push(ticket(small))
    queue.push(b := ticket(small))
    refused = []
    for _ in range(2):
        with pytest.raises(Rejected):
            queue.push(item := ticket(small))
        refused.append(item)
    list(drain(queue, 1))
    queue.push(e := ticket(small))
    assert queue.push(c := back(refused[0])) == [e]
    assert queue.push(e_back := back(e)) == []  # the newest: it waits past the limit
    assert queue.push(d := back(refused[1])) == [e_back]
    assert list(queue.tickets()) == [b, c, d]
    # The byte limit holds for returning requests too: nothing is pushed out for bytes.
    capped = TenantPolicy("bytes", max_queued=1, max_queued_bytes=10)
    queue = FairQueue()
    queue.push(ticket(capped, size=5))
    with pytest.raises(Rejected):
        queue.push(refused := ticket(capped, size=6))
    list(drain(queue, 1))
    queue.push(meanwhile := ticket(capped, size=5))
    with pytest.raises(Rejected) as too_big:
        queue.push(back(refused))
    assert too_big.value.why == "tenant_queue_bytes_full" and meanwhile.queued


def test_kept_turns_come_back_at_their_slot_once_and_are_bounded() -> None:
    turns = KeptTurns(grace_s=120.0, max_kept=3)
    turns.keep(b"a", back_at=10.0, first_seq=7, now=0.0)
    assert turns.back(b"a", now=5.0) == 0  # early: not back on its turn
    assert turns.back(b"a", now=9.9) == 7  # on time, within a timer's slack
    assert turns.back(b"a", now=11.0) == 0  # used up
    assert turns.back(b"unknown", now=11.0) == 0
    turns.keep(b"late", back_at=10.0, first_seq=8, now=0.0)
    assert turns.back(b"late", now=131.0) == 0  # its turn lapsed
    for seq, name in enumerate((b"1", b"2", b"3", b"4"), start=1):
        turns.keep(name, back_at=200.0, first_seq=seq, now=100.0)
    assert len(turns) == 3 and turns.back(b"1", now=200.0) == 0  # the oldest went
    turns.keep(b"5", back_at=400.0, first_seq=5, now=330.0)  # the others lapsed meanwhile
    assert len(turns) == 1 and turns.back(b"5", now=400.0) == 5
    # Requests with the same body (a block every page has) each keep a turn of their own.
    turns.keep(b"same", back_at=500.0, first_seq=10, now=400.0)
    turns.keep(b"same", back_at=505.0, first_seq=11, now=401.0)
    assert turns.back(b"same", now=500.0) == 10
    assert turns.back(b"same", now=501.0) == 0  # the other one's slot is later
    assert turns.back(b"same", now=505.0) == 11 and not turns


def test_a_full_byte_budget_sheds_by_bytes_over_weight() -> None:
    queue = FairQueue(QueueLimits(max_queued_bytes=100))
    heavy = TenantPolicy("heavy", weight=4.0)
    pages = [ticket(heavy, size=20) for _ in range(4)]  # 80 bytes, 20 per unit of weight
    for item in pages:
        queue.push(item)
    blocks = [ticket(A, size=15) for _ in range(2)]  # 30 bytes, 30 per unit of weight
    queue.push(blocks[0])
    assert queue.push(blocks[1]) == [blocks[1]]
    assert queue.queued_bytes <= 100


def test_removing_tickets_keeps_counts_and_forgets_idle_tenants() -> None:
    queue = FairQueue()
    items = [ticket(A, size=10) for _ in range(3)]
    for item in items:
        queue.push(item)
    queue.remove(items[1])
    queue.remove(items[1])  # twice: no effect
    assert (len(queue), queue.queued_bytes) == (2, 20)
    assert queue.depth() == {("a", 0): (2, 20)}
    for item in (items[0], items[2]):
        queue.remove(item)
    assert queue.is_idle() and queue.depth() == {}
    assert queue._tenants == {}  # bounded memory: nothing is kept for an idle tenant


def test_an_ineligible_head_lets_other_tenants_pass() -> None:
    queue = FairQueue()
    blocked = Ticket(A, 0, 1.0, 1, 0.0, model="elsewhere")
    queue.push(blocked)
    other = Ticket(B, 0, 1.0, 1, 0.0, model="here")
    queue.push(other)
    assert queue.next(lambda t: t.model == "here") is other
    assert queue.next(lambda t: False) is None


def _view(
    in_flight: int = 0,
    *,
    waiting: float | None = None,
    running: float = 0.0,
    own_at_scrape: int = 0,
    kv: float = 0.1,
    batch: int | None = 10,
    healthy: bool = True,
    age_s: float = 0.1,
) -> WorkerView:
    reported = None if waiting is None else ReportedLoad(waiting, running, kv, age_s, own_at_scrape)
    reported = LoadModel().fresh(reported)  # as the registry builds views
    return WorkerView(
        "w", healthy=healthy, in_flight=in_flight, reported=reported, batch_limit=batch
    )


@pytest.mark.parametrize(
    ("view", "room"),
    [
        (_view(0), True),
        (_view(11), True),  # batch 10 + headroom 2 (at least 2)
        (_view(12), False),
        (_view(5, waiting=0, running=8, own_at_scrape=0), False),  # 8 sent by others
        (_view(5, waiting=0, running=8, own_at_scrape=5), True),  # those 8 include ours
        (_view(3, waiting=3, running=3, own_at_scrape=3), True),  # waiting for the next step
        (_view(3, waiting=3, running=3, own_at_scrape=6, kv=0.97), False),  # short of KV
        (_view(3, waiting=3, running=3, own_at_scrape=6, kv=0.97, age_s=5.0), True),  # stale
        (_view(0, healthy=False), False),
        (_view(257, batch=None), True),  # not yet learnt: vLLM's default 256, +2
        (_view(258, batch=None), False),
    ],
)
def test_room_on_a_worker(view: WorkerView, room: bool) -> None:
    assert RoomPolicy().has_room(view) is room


def test_one_policy_gives_each_batch_size_its_own_capacity() -> None:
    # The capacity of each batch size is kept: workers with other sizes must not share it.
    policy = RoomPolicy(headroom=0.5)
    sizes = [10, None, 10, 100, None, 3]
    assert [policy.capacity(_view(0, batch=size)) for size in sizes] == [15, 384, 15, 150, 384, 5]
    assert policy.has_room(_view(14, batch=10)) and not policy.has_room(_view(15, batch=10))
    assert policy.has_room(_view(149, batch=100)) and not policy.has_room(_view(150, batch=100))
    # free room: each worker's capacity less what it holds, at least one
    views = [_view(10, batch=10), _view(0, batch=100), _view(20, batch=10)]
    assert policy.free(views) == 5 + 150 + 1


def test_drain_rate_reads_the_pace_of_dispatches_in_its_window() -> None:
    rate = DrainRate(window_s=10.0, min_span_s=5.0)
    assert rate.rate(0.0) == 0.0
    for step in range(21):
        rate.record(step * 0.5)  # 2 per second
    assert rate.rate(10.0) == pytest.approx(2.1, abs=0.1)
    assert rate.rate(100.0) == 0.0  # the window has passed


def test_a_burst_does_not_read_as_the_fleets_pace() -> None:
    rate = DrainRate(window_s=10.0, min_span_s=5.0)
    for _ in range(12):
        rate.record(1.0)  # idle workers filled in one instant
    assert rate.rate(1.001) == pytest.approx(12 / 5)


def test_requests_refused_together_are_told_to_come_back_one_dispatch_apart() -> None:
    rate = DrainRate(window_s=10.0, min_span_s=5.0)
    for step in range(21):
        rate.record(step * 0.5)  # ~2 per second
    waits = [rate.retry_after(8, now=10.0) for _ in range(40)]
    assert waits[0] == pytest.approx(8 / 2.1, abs=0.2)  # the queue ahead drains first
    gaps = {round(b - a, 6) for a, b in itertools.pairwise(waits)}
    assert gaps == {round(1 / rate.rate(10.0), 6)}  # then one slot each
    assert waits[-1] == pytest.approx((8 + 39) / 2.1, abs=1)


def test_slots_already_passed_do_not_delay_later_refusals() -> None:
    rate = DrainRate(window_s=10.0, min_span_s=5.0)
    for step in range(21):
        rate.record(step * 0.5)
    for _ in range(10):
        rate.retry_after(0, now=10.0)  # slots up to ~5 s ahead
    for step in range(21):
        rate.record(30.0 + step * 0.5)
    assert rate.retry_after(4, now=40.0) == pytest.approx(4 / 2.1, abs=0.2)


def test_retry_after_stays_between_one_second_and_what_mineru_honours() -> None:
    rate = DrainRate(window_s=10.0, min_span_s=5.0)
    assert rate.retry_after(0, now=0.0) == 1.0  # nothing dispatched: 1 per second assumed
    assert rate.retry_after(5, now=0.0) == pytest.approx(5.0)
    assert rate.retry_after(10_000, now=0.0) == 120.0
    assert rate.retry_after(10_000, now=0.0) == 120.0  # slots do not run away past the cap


# -- documents: flows inside a tenant, steps inside a flow --------------------------------------

L, T = PromptKind.LAYOUT, PromptKind.TEXT


def doc(
    name: str | None, kind: PromptKind = L, cost: float = 1.0
) -> tuple[str | None, PromptKind, float]:
    return (name, kind, cost)


@pytest.mark.parametrize(
    ("before", "served_first", "after", "expected", "order_steps"),
    [
        # No ids: one flow, FIFO (layout and other requests alike).
        ([doc(None)] * 3, 0, [], [None, None, None], True),
        # A document arriving while another has been served goes first (least attained service).
        (
            [doc("big")] * 6,
            2,
            [doc("small")] * 2,
            ["small", "small", "big", "big", "big", "big"],
            True,
        ),
        # Two documents with equal service share turns (ties: the earliest arrival).
        ([doc("x"), doc("x"), doc("y"), doc("y")], 0, [], ["x", "y", "x", "y"], True),
        # Service is counted on cost: a document of cheap requests gets more of them.
        (
            [doc("pages", cost=2.0)] * 3 + [doc("blocks", T, 1.0)] * 6,
            0,
            [],
            ["pages", "blocks", "blocks", "pages", "blocks", "blocks", "pages", "blocks", "blocks"],
            True,
        ),
        # The default flow is a flow like the others.
        ([doc(None)] * 4, 2, [doc("d")], ["d", None, None], True),
    ],
)
def test_documents_share_their_tenants_turns_by_least_attained_service(
    before: list[tuple[str | None, PromptKind, float]],
    served_first: int,
    after: list[tuple[str | None, PromptKind, float]],
    expected: list[str | None],
    order_steps: bool,
) -> None:
    queue = FairQueue(QueueLimits(order_steps=order_steps))
    for flow, kind, cost in before:
        queue.push(ticket(A, flow=flow, kind=kind, cost=cost))
    list(drain(queue, served_first))
    for flow, kind, cost in after:
        queue.push(ticket(A, flow=flow, kind=kind, cost=cost))
    assert [t.flow for t in drain(queue)] == expected


@pytest.mark.parametrize(
    ("kinds", "order_steps", "expected"),
    [
        # Blocks of pages already laid out go ahead of new pages' layout requests.
        ("LLTLT", True, "TTLLL"),
        ("LTFLB", True, "TFBLL"),  # text, formula and table (B) blocks alike
        ("LOTL", True, "TLOL"),  # other requests keep their place among layouts
        ("LLTLT", False, "LLTLT"),  # first come, first served when steps are not ordered
    ],
)
def test_inside_a_flow_blocks_go_ahead_of_new_layout_requests(
    kinds: str, order_steps: bool, expected: str
) -> None:
    letters = {
        "L": PromptKind.LAYOUT,
        "T": PromptKind.TEXT,
        "F": PromptKind.FORMULA,
        "B": PromptKind.TABLE,
        "O": PromptKind.OTHER,
    }
    names = {kind: letter for letter, kind in letters.items()}
    queue = FairQueue(QueueLimits(order_steps=order_steps))
    for letter in kinds:
        queue.push(ticket(A, flow="doc", kind=letters[letter]))
    assert "".join(names[t.kind] for t in drain(queue)) == expected


def test_documents_do_not_change_the_share_between_tenants() -> None:
    queue = FairQueue()
    for index in range(200):
        queue.push(ticket(A, flow=f"doc-{index % 20}"))
        queue.push(ticket(B))
    served = Counter(t.name for t in drain(queue, 100))
    assert served == {"a": 50, "b": 50}


def test_flows_are_bounded_idle_ones_forgotten_new_ones_folded_when_all_are_busy() -> None:
    queue = FairQueue(QueueLimits(max_flows=2))
    first, second = ticket(A, flow="one"), ticket(A, flow="two")
    queue.push(first)
    queue.push(second)
    folded = ticket(A, flow="three")
    queue.push(folded)  # both flows busy: joins the tenant's default flow
    assert folded.flow is None and queue.folded == 1
    assert queue.flows_by_tenant() == {"a": 3}
    for served in drain(queue, 3):
        assert served.queued is False
    assert queue.flows_by_tenant() == {}  # everything done: the idle tenant is forgotten
    # An idle flow is forgotten to make room for a new one, least recently used first.
    keep = ticket(A, flow="one")
    queue.push(keep)
    started = queue.next()
    assert started is keep
    queue.pop(started)  # "one" stays busy (in flight)
    queue.push(ticket(A, flow="two"))
    head = queue.next()
    assert head is not None
    queue.pop(head)
    queue.done(head)  # "two" is idle now, remembered
    fresh = ticket(A, flow="four")
    queue.push(fresh)
    assert fresh.flow == "four" and queue.folded == 1
    assert set(queue._tenants["a"].flows) == {"one", "four"}


def test_a_document_keeps_its_service_while_its_requests_are_on_workers() -> None:
    """Between a page's layout and its blocks nothing of the document is queued; it must not
    come back as a new document."""
    queue = FairQueue()
    for _ in range(4):
        queue.push(ticket(A, flow="big", kind=L))
    big = list(drain_started(queue, 4))  # all on workers, none queued
    queue.push(ticket(A, flow="big", kind=T))
    queue.push(ticket(A, flow="small", kind=L))
    assert [t.flow for t in drain(queue)] == ["small", "big"]
    for item in big:
        queue.done(item)


def drain_started(queue: FairQueue, count: int) -> Iterator[Ticket]:
    """Starts up to `count` tickets in the queue's order without ending them."""
    for _ in range(count):
        head = queue.next()
        if head is None:
            return
        queue.pop(head)
        yield head


def test_queued_requests_by_task() -> None:
    queue = FairQueue()
    for kind in (L, L, T, PromptKind.TABLE, PromptKind.OTHER):
        queue.push(ticket(A, kind=kind))
    assert queue.by_task() == {"layout": 2, "block": 2, "other": 1}


def test_a_full_queue_sheds_the_newest_request_across_a_tenants_flows() -> None:
    queue = FairQueue(QueueLimits(max_queued=3))
    kept = [ticket(A, flow="x"), ticket(A, flow="y", kind=T), ticket(A, flow="x", kind=T)]
    for item in kept:
        assert queue.push(item) == []
    newest = ticket(A, flow="y")
    assert queue.push(newest) == [newest]


# -- the reserve: room kept for tenants and documents below their share -------------------------


def test_the_reserve_is_room_outside_which_a_request_at_its_share_must_fit() -> None:
    room = RoomPolicy(min_headroom=2, reserve=2)
    assert room.capacity(_view(batch=10)) == 12
    assert room.has_room(_view(10, batch=10)) and not room.has_open_room(_view(10, batch=10))
    assert room.has_open_room(_view(9, batch=10))
    assert RoomPolicy(min_headroom=2).has_open_room(_view(11, batch=10))  # no reserve
    # However large the reserve, one request's room stays open: a lone tenant never stalls.
    huge = RoomPolicy(min_headroom=2, reserve=50)
    assert huge.has_open_room(_view(0, batch=10)) and not huge.has_open_room(_view(1, batch=10))


@pytest.mark.parametrize(
    ("in_flight", "asking", "below"),
    [
        # tenant or (tenant, document) -> requests in flight; who asks; below its share?
        ({A: 5}, A, False),  # alone: the reserve is not its
        ({A: 5}, B, True),  # another tenant with nothing in flight
        ({A: 5, B: 5}, B, False),
        ({A: 5, B: 4}, B, True),
        ({(A, "big"): 20}, (A, "small"), True),  # a new document of the same tenant
        ({(A, "big"): 20, (A, "small"): 3}, (A, "small"), True),
        ({(A, "big"): 20, (A, "small"): 3}, (A, "big"), False),
        ({(A, None): 4}, (A, "doc"), True),  # a document next to requests without one
        ({(A, "doc"): 4}, A, True),  # and the other way round
    ],
)
def test_below_its_share_between_tenants_then_between_a_tenants_documents(
    in_flight: dict[TenantPolicy | tuple[TenantPolicy, str | None], int],
    asking: TenantPolicy | tuple[TenantPolicy, str | None],
    below: bool,
) -> None:
    queue = FairQueue()
    for who, count in in_flight.items():
        tenant, flow = who if isinstance(who, tuple) else (who, None)
        for _ in range(count):
            queue.start_unqueued(ticket(tenant, flow=flow))
    tenant, flow = asking if isinstance(asking, tuple) else (asking, None)
    assert queue.below_share(ticket(tenant, flow=flow)) is below

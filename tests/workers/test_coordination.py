"""The dispatcher's one interface to its sibling processes (two processes' tables, one test)."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from mineru_gateway.flow import FairQueue, RoomPolicy, TenantPolicy, Ticket
from mineru_gateway.routing import WorkerView
from mineru_gateway.workers.coordination import ALONE, HEAD_FRESH_S, Shared
from mineru_gateway.workers.group_load import GroupLoad, QueueHeads

ROOM = RoomPolicy(headroom=0.0, min_headroom=0)
ONE_SLOT = [WorkerView("http://w0", True, 0, frozenset({"m"}), batch_limit=1)]


def ticket(tenant: str, priority: int = 0) -> Ticket:
    return Ticket(TenantPolicy(tenant), priority, 1.0, 100, time.monotonic(), "m")


def test_a_gateway_of_one_process_holds_nothing_and_never_gives_way() -> None:
    queue = FairQueue()
    with ALONE.deciding():  # no file, no lock: nothing to block the event loop
        ALONE.post_head(queue)
    assert ALONE.poll_s is None
    assert not ALONE.gives_way(ticket("a"), ONE_SLOT, queue, ROOM)


def test_room_is_left_to_a_more_urgent_head_elsewhere_and_its_process_rung(
    tmp_path: Path,
) -> None:
    rung: list[int] = []
    table = GroupLoad(tmp_path / "t", 2, 0)
    ours = Shared(table, QueueHeads(tmp_path / "heads", 2, 0), rung.append)
    theirs = QueueHeads(tmp_path / "heads", 2, 1)
    mine = ticket("a", priority=1)
    assert not ours.gives_way(mine, ONE_SLOT, FairQueue(), ROOM), "nothing waits elsewhere"
    urgent = ticket("b", priority=0)
    theirs.post(time.monotonic(), 0, "b", 1.0, 0.0, "m", urgent.enqueued_at)
    assert ours.gives_way(mine, ONE_SLOT, FairQueue(), ROOM)
    assert rung == [1]
    two_slots = [*ONE_SLOT, WorkerView("http://w1", True, 0, frozenset({"m"}), batch_limit=1)]
    assert not ours.gives_way(mine, two_slots, FairQueue(), ROOM), "room for both"
    time.sleep(HEAD_FRESH_S * 1.5)  # their process posts no more: its head is passed over
    assert not ours.gives_way(mine, ONE_SLOT, FairQueue(), ROOM)


def test_a_posted_head_is_seen_by_the_siblings_and_cleared_with_the_queue(
    tmp_path: Path,
) -> None:
    table = GroupLoad(tmp_path / "t", 2, 0)
    ours = Shared(table, QueueHeads(tmp_path / "heads", 2, 0), lambda index: None)
    sibling = QueueHeads(tmp_path / "heads", 2, 1)
    queue = FairQueue()
    waiting = ticket("a")
    queue.push(waiting)
    ours.post_head(queue)
    assert sibling.waiting(time.monotonic() - HEAD_FRESH_S) == [0]
    queue.remove(waiting)
    ours.post_head(queue)
    assert sibling.waiting(0.0) == []


def test_a_decision_holds_the_processes_table(tmp_path: Path) -> None:
    table = GroupLoad(tmp_path / "t", 2, 0)
    ours = Shared(table, QueueHeads(tmp_path / "heads", 2, 0), lambda index: None)
    other = os.open(tmp_path / "t", os.O_RDWR)
    try:
        with ours.deciding():
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = False
            except BlockingIOError:
                held = True
        assert held
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # and let go after
    finally:
        os.close(other)

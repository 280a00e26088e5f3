"""The table of every gateway process's in-flight requests per worker (workers/group_load.py):
each process sees the others' counts at once and not its own, columns are the same for every
process whatever order they meet the workers in, a process that starts again holds nothing."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
from pathlib import Path

import pytest

from mineru_gateway.workers.group_load import (
    TENANT_WIDTH,
    GroupFull,
    GroupLoad,
    GroupTenants,
    QueueHeads,
    model_key,
)

URLS = ["http://a:1", "http://b:1", "http://c:1"]


def test_each_process_sees_the_others_counts_and_not_its_own(tmp_path: Path) -> None:
    first, second = GroupLoad(tmp_path / "t", 2, 0), GroupLoad(tmp_path / "t", 2, 1)
    a, b = first.column(URLS[0]), second.column(URLS[1])
    assert a != b and second.column(URLS[0]) == a and first.column(URLS[1]) == b
    (first_a, first_b), (second_a, second_b) = [
        [t.worker(u) for u in URLS[:2]] for t in (first, second)
    ]
    first_a.publish(3, 2.5)
    assert second_a.others() == (3, 2.5)
    assert first_a.others() == (0, 0.0)  # its own are not others'
    assert second_b.others() == (0, 0.0)
    first_a.publish(2, 1.5)  # a count is the process's whole count, not a change
    second_b.publish(1, 1.0)
    assert (second_a.others(), first_b.others()) == ((2, 1.5), (1, 1.0))


def test_a_process_that_starts_again_holds_nothing(tmp_path: Path) -> None:
    first, second = GroupLoad(tmp_path / "t", 2, 0), GroupLoad(tmp_path / "t", 2, 1)
    a = first.column(URLS[0])
    first.worker(URLS[0]).publish(3, 2.5)
    second.worker(URLS[0]).publish(1, 1.0)
    first.close()  # it died holding three requests
    again = GroupLoad(tmp_path / "t", 2, 0)
    assert second.worker(URLS[0]).others() == (0, 0.0)
    assert again.worker(URLS[0]).others() == (1, 1.0)  # the other process's row is untouched
    assert again.column(URLS[0]) == a


def test_columns_are_claimed_once_each_until_the_table_is_full(tmp_path: Path) -> None:
    table = GroupLoad(tmp_path / "t", 1, 0, columns=4)
    urls = [f"http://w{n}:1" for n in range(4)]
    columns = [table.column(url) for url in urls]
    assert sorted(columns) == [0, 1, 2, 3]  # collisions probe on to a free column
    assert [table.column(url) for url in reversed(urls)] == columns[::-1]
    with pytest.raises(GroupFull):
        table.column("http://w4:1")


def _claim_and_publish(path: Path, urls: list[str]) -> None:
    table = GroupLoad(path, 2, 1)
    for count, url in enumerate(urls, start=1):
        table.worker(url).publish(count, count / 2)


def test_another_process_claims_and_counts_through_the_same_file(tmp_path: Path) -> None:
    path = tmp_path / "t"
    mine = GroupLoad(path, 2, 0)
    columns = {url: mine.column(url) for url in URLS[:2]}  # this one meets a and b first
    child = multiprocessing.get_context("spawn").Process(
        target=_claim_and_publish, args=(path, list(reversed(URLS)))
    )
    child.start()
    child.join(30)
    assert child.exitcode == 0
    columns[URLS[2]] = mine.column(URLS[2])  # claimed by the child: found, not claimed again
    assert len(set(columns.values())) == 3
    # The child published c: 1, b: 2, a: 3 (its order), each under the column this one has.
    assert [mine.worker(url).others() for url in URLS] == [(3, 1.5), (2, 1.0), (1, 0.5)]


def test_the_lock_holds_until_the_outermost_block_ends(tmp_path: Path) -> None:
    table = GroupLoad(tmp_path / "t", 2, 0)
    other = os.open(tmp_path / "t", os.O_RDWR)  # another open file: as another process

    def held() -> bool:
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(other, fcntl.LOCK_UN)
        return False

    try:
        with table.locked():
            with table.locked():  # a release within a decision pumps the queue, which decides
                assert held()
            assert held()
        assert not held()
    finally:
        os.close(other)


def test_tenants_counts_are_shared_by_name_and_a_full_table_counts_alone(tmp_path: Path) -> None:
    def tenants(index: int) -> GroupTenants:
        return GroupTenants(GroupLoad(tmp_path / "t", 2, index, columns=2, width=TENANT_WIDTH))

    first, second = tenants(0), tenants(1)
    first.publish("a", 3, 2, 2048)
    second.publish("b", 1, 0, 0)
    assert second.others("a") == (3, 2, 2048) and first.others("b") == (1, 0, 0)
    assert first.others("a") == (0, 0, 0)  # its own are not others'
    first.publish("a", 0, 1, 1024)  # the whole count, not a change
    assert second.others("a") == (0, 1, 1024)
    first.publish("c", 5, 5, 5)  # both columns are taken: c is counted where it is
    assert second.others("c") == (0, 0, 0)


def test_queue_heads_rank_by_band_then_live_share_then_age_and_go_stale(tmp_path: Path) -> None:
    def tenants(index: int) -> GroupTenants:
        return GroupTenants(GroupLoad(tmp_path / "t", 3, index, columns=8, width=TENANT_WIDTH))

    counts = [tenants(index) for index in range(3)]
    heads = [QueueHeads(tmp_path / "h", 3, index, counts[index]) for index in range(3)]
    counts[1].publish("b", 1, 1, 10)  # b: 1 in flight (process 1), weight 2: share 0.5
    counts[0].publish("a", 2, 0, 0)
    heads[1].post(10.0, 0, "b", 2.0, 0.5, "m", queued_at=7.0)
    heads[2].post(10.0, -1, "c", 1.0, 0.0, None, queued_at=8.0)
    key = model_key("m")
    assert 0 < key < 2**52 and model_key(None) == 0.0
    # (process, model key, when queued): b's smaller share in 1; a lower band in 2
    assert heads[0].ahead(0, 2.0, 9.0, since=9.0) == [(1, key, 7.0), (2, 0.0, 8.0)]
    # c's share is read from the table too
    assert heads[0].ahead(-1, 0.0, 9.0, since=9.0) == [(2, 0.0, 8.0)]  # equal, but older
    assert heads[0].ahead(-1, 0.0, 7.5, since=9.0) == []
    assert heads[1].ahead(0, 0.5, 9.0, since=9.0) == [(2, 0.0, 8.0)]  # its own is not another's
    # Shares are read when asked: b's request ended, and b now holds nothing.
    counts[1].publish("b", 0, 1, 10)
    assert heads[0].ahead(0, 0.0, 9.0, since=9.0) == [(1, key, 7.0), (2, 0.0, 8.0)]  # older
    assert heads[0].ahead(0, 0.0, 6.0, since=9.0) == [(2, 0.0, 8.0)]  # this one waited longer
    assert heads[0].ahead(0, 1.0, 9.0, since=10.5) == []  # posted before `since`: stale
    assert heads[0].posted_since(10.0) and not heads[0].posted_since(10.5)
    assert heads[0].waiting(10.0) == [1, 2] and heads[0].waiting(10.5) == []
    heads[2].clear()
    assert heads[0].ahead(5, 1.0, 9.0, since=0.0) == [(1, key, 7.0)]
    assert heads[1].posted_since(0.0) is False  # 2's was cleared, and its own does not count
    heads[1].close()
    restarted = QueueHeads(tmp_path / "h", 3, 1, counts[1])
    assert heads[0].ahead(5, 1.0, 9.0, since=0.0) == []  # restarted: none
    assert not heads[0].posted_since(0.0) and heads[0].waiting(0.0) == []
    restarted.close()


def test_a_heads_share_keeps_what_other_replicas_hold_of_its_tenant(tmp_path: Path) -> None:
    """With fleet state a share counts other replicas' requests too: what the posted share
    holds beyond the replica's table stays with the head, and the table's part is read live."""

    def tenants(index: int) -> GroupTenants:
        return GroupTenants(GroupLoad(tmp_path / "t", 2, index, columns=8, width=TENANT_WIDTH))

    counts = [tenants(index) for index in range(2)]
    heads = [QueueHeads(tmp_path / "h", 2, index, counts[index]) for index in range(2)]
    counts[1].publish("b", 1, 1, 10)
    heads[1].post(10.0, 0, "b", 1.0, 5.0, "m", queued_at=7.0)  # 1 here, 4 in other replicas
    assert heads[0].ahead(0, 4.5, 9.0, since=9.0) == []  # 5 > 4.5
    assert heads[0].ahead(0, 5.5, 9.0, since=9.0) == [(1, model_key("m"), 7.0)]
    counts[1].publish("b", 0, 1, 10)  # its request here ended: 4 left, in other replicas
    assert heads[0].ahead(0, 4.5, 9.0, since=9.0) == [(1, model_key("m"), 7.0)]


def test_a_head_whose_tenant_has_no_column_is_ranked_by_its_posted_share(tmp_path: Path) -> None:
    full = GroupTenants(GroupLoad(tmp_path / "t", 2, 1, columns=1, width=TENANT_WIDTH))
    full.publish("first", 5, 0, 0)  # takes the only column
    heads = [QueueHeads(tmp_path / "h", 2, 0), QueueHeads(tmp_path / "h", 2, 1, full)]
    heads[1].post(10.0, 0, "second", 1.0, 3.0, None, queued_at=1.0)
    assert heads[0].ahead(0, 4.0, 9.0, since=9.0) == [(1, 0.0, 1.0)]
    assert heads[0].ahead(0, 2.0, 9.0, since=9.0) == []


def test_a_column_no_process_holds_any_more_is_reused_once_the_table_is_full(
    tmp_path: Path,
) -> None:
    first = GroupLoad(tmp_path / "t", 2, 0, columns=2, reclaim_after_s=0.0)
    second = GroupLoad(tmp_path / "t", 2, 1, columns=2, reclaim_after_s=0.0)
    gone, kept = first.column(URLS[0]), first.column(URLS[1])
    second.column(URLS[0])
    first.release(URLS[0])
    with pytest.raises(GroupFull):  # the second process still holds the worker
        first.column(URLS[2])
    second.worker(URLS[0]).publish(2, 2.0)
    second.release(URLS[0])  # its figures go with it
    assert first.column(URLS[2]) == gone
    assert first.worker(URLS[2]).others() == (0, 0.0)
    assert first.column(URLS[1]) == kept  # probing goes on past a reused column
    assert second.column(URLS[1]) == kept


def test_a_falling_count_changes_the_release_number(tmp_path: Path) -> None:
    first, second = GroupLoad(tmp_path / "t", 2, 0), GroupLoad(tmp_path / "t", 2, 1)
    column = first.worker(URLS[0])
    before = second.releases()
    column.publish(2, 2.0)
    assert second.releases() == before
    column.publish(1, 1.0)
    assert second.releases() != before

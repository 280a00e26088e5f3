"""The registry's membership: the workers, their drains, and who hears of a change."""

from __future__ import annotations

import pytest

from mineru_gateway.workers.membership import Membership

pytestmark = pytest.mark.unit


def test_changes_are_heard_and_adding_a_member_twice_keeps_one() -> None:
    membership = Membership(["http://a:1"])
    heard: list[int] = []
    membership.on_change(lambda: heard.append(1))
    added = membership.add("http://b:1")
    assert membership.add("http://b:1") is added
    assert [w.url for w in membership.workers] == ["http://a:1", "http://b:1"]
    assert membership.drain("http://b:1").draining and not added.routable
    membership.undrain("http://b:1")
    membership.remove("http://a:1")
    membership.remove("http://gone:1")  # not a member: nothing to do, still heard
    assert [w.url for w in membership.workers] == ["http://b:1"]
    assert len(heard) == 4


def test_only_healthy_members_offer_their_models() -> None:
    membership = Membership(["http://a:1", "http://b:1"])
    a, b = membership.workers
    a.models, b.models = {"m": {"id": "m"}}, {"m": {"id": "m", "b": 1}, "n": {"id": "n"}}
    assert not membership.any_healthy() and membership.models() == []
    b.healthy = True
    assert membership.any_healthy()
    assert sorted(card["id"] for card in membership.models()) == ["m", "n"]

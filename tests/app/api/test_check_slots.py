"""How upload completions share the check slots (app/api/check_slots.py), request by request: the rules
the service test (tests/app/api/test_hostile_uploads.py) shows through the API, here each one alone."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from app.api import check_slots
from app.api.check_slots import CheckSlots
from app.core.errors import ServiceUnavailable, TooManyRequests


def take(stack: ExitStack, slots: CheckSlots, tenant: str | None, upload: str) -> None:
    stack.enter_context(slots.slot(tenant, upload))


def test_two_tenants_cannot_hold_every_slot_a_third_one_needs():
    """Issue 41: A and B held 2 completions each (4 slots) and C's was 503 for as long as theirs ran."""
    slots = CheckSlots(total=4, per_tenant=2)
    with ExitStack() as held:
        take(held, slots, "a", "a1")
        take(held, slots, "a", "a2")
        take(held, slots, "b", "b1")
        with pytest.raises(TooManyRequests, match="kept for other tenants"):
            take(held, slots, "b", "b2")  # the last free slot: B holds one already
        take(held, slots, "c", "c1")  # C, holding none, gets it
        with pytest.raises(ServiceUnavailable):
            take(held, slots, "d", "d1")
        assert slots.held == {"a": 2, "b": 1, "c": 1}
    assert slots.held == {}


def fill_until_refused(slots: CheckSlots, tenant: str) -> None:
    """Hold every slot with tenants c, d, e … (one each) until `tenant` is refused 503, then let them go."""
    with ExitStack() as others:
        for k in range(slots.total - sum(slots.held.values())):
            take(others, slots, f"other{k}", "x")
        with pytest.raises(ServiceUnavailable):
            take(others, slots, tenant, f"{tenant}1")


def test_a_tenant_holding_a_slot_takes_no_more_while_another_waits(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(check_slots.time, "monotonic", lambda: clock[0])
    slots = CheckSlots(total=4, per_tenant=4)
    with ExitStack() as held:
        take(held, slots, "a", "a1")
        fill_until_refused(slots, "b")
        # three slots free again; A holds one: while B waits (refused 503 just now) A takes no second
        with pytest.raises(TooManyRequests, match="kept for other tenants"):
            take(held, slots, "a", "a2")
        take(held, slots, "b", "b1")  # B comes back and gets its slot: it waits no more
        take(held, slots, "a", "a2")
        assert slots.waiting == {}
    with ExitStack() as held:  # a tenant that never comes back waits WAITING_S at most
        take(held, slots, "a", "a1")
        fill_until_refused(slots, "b")
        clock[0] += check_slots.WAITING_S + 1
        take(held, slots, "a", "a2")
        assert slots.waiting == {}
    assert slots.held == {}


def test_the_open_api_has_one_user_and_every_slot():
    slots = CheckSlots(total=2, per_tenant=2)
    with ExitStack() as held:
        take(held, slots, None, "u1")
        take(held, slots, None, "u2")
        assert slots.held == {"": 2}

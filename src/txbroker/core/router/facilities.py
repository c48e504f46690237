"""Facilities: their definitions and partition settings, durable in the router's
journal (one live record per facility, replaced on every change).

A facility is defined by an administrator (``rtr_define``), by the
configuration file at start, or grows a partition when a server registers a key
range no partition has (the seed's servers define partitions by their range).
A facility with transactions in flight or registered controllers cannot be
redefined. The record also lists the facility's partitions that have a shadow site
(``RouterData.shadowed``, written when a partition's first shadow registers), so
that a restart keeps their transactions for a secondary site that is down.
"""

from __future__ import annotations

from typing import Any

from txbroker.core.outbox import OnDurable
from txbroker.core.queue_index import LATER
from txbroker.core.router.data import RouterData
from txbroker.core.router.model import Facility, parse_facility
from txbroker.core.router.records import FacilityRecord
from txbroker.errors import BadRequest, IllegalState


def define(router: RouterData, session_id: int, rid: int, name: Any, partitions: Any,
           now: int) -> Any:
    """Define (or redefine) a facility; answered once its record is durable."""
    facility = parse_facility(name, partitions)
    current = router.facilities.get(facility.name)
    if current is not None and current.to_dict() == facility.to_dict():
        return facility.to_dict()
    if current is not None and any(t.facility == facility.name
                                   for t in router.transactions.values()):
        raise IllegalState(f"facility {facility.name!r} has transactions in flight: "
                           "it cannot be redefined now")
    if current is not None and any(c.facility == facility.name
                                   for c in router.controllers.values()):
        raise IllegalState(f"facility {facility.name!r} has registered controllers: "
                           "it cannot be redefined now")
    store(router, facility, now, router.outbox.reply_when_durable(
        session_id, rid, facility.to_dict()))
    return LATER


def store(router: RouterData, facility: Facility, now: int, on_durable: OnDurable) -> None:
    """Keep ``facility`` and write its record, with its shadowed partitions (replacing
    the previous one)."""
    router.facilities[facility.name] = facility
    shadowed = [p.name for p in facility.partitions
                if (facility.name, p.name) in router.shadowed]
    router.facility_records[facility.name] = router.log.write(
        FacilityRecord.of(facility, shadowed), router.facility_records.get(facility.name),
        now, on_durable)


def define_from_config(router: RouterData, name: str, partitions: Any, now: int) -> None:
    """A facility of the configuration file: defined unless the journal already
    has the same one (a different one is redefined when nothing uses it)."""
    facility = parse_facility(name, partitions)
    current = router.facilities.get(facility.name)
    if current is not None and current.to_dict() == facility.to_dict():
        return
    if current is not None and any(t.facility == name for t in router.transactions.values()):
        raise IllegalState(f"facility {name!r} of the configuration differs from the "
                           "journal's and has transactions in flight")
    store(router, facility, now, router.outbox.ignore_durable)


def set_partition(router: RouterData, session_id: int, rid: int, facility_name: Any,
                  partition: Any, retry_count: Any, vote_timeout_ms: Any, now: int) -> Any:
    """Change a partition's retry count or vote timeout (durable before the reply)."""
    facility = router.facility(facility_name)
    if not isinstance(partition, str):
        raise BadRequest("argument 'partition' must be a partition name")
    old = facility.partition(partition)
    new = old.with_settings(retry_count, vote_timeout_ms)
    updated = Facility(facility.name, [new if p is old else p for p in facility.partitions])
    store(router, updated, now, router.outbox.reply_when_durable(session_id, rid,
                                                                  new.to_dict()))
    return LATER


def add_key_range(router: RouterData, facility: Facility, key_range: Any, now: int
                  ) -> Facility:
    """A server registers a key range no partition has (the seed's servers define
    partitions by their key range): the facility gets a partition of that range,
    named ``low-high``, durably (BadRequest if it overlaps another partition or
    its keys are of another type)."""
    low, high = key_range
    parts = [p.to_dict() for p in facility.partitions]
    parts.append({"name": f"{low}-{high}", "low": low, "high": high})
    updated = parse_facility(facility.name, parts)
    router.outbox.check_writable()
    store(router, updated, now, router.outbox.ignore_durable)
    return updated


__all__ = ["add_key_range", "define", "define_from_config", "set_partition", "store"]

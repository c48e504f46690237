"""The checkers of scenario ``xa-live`` (``live_xa.py``): what the workers saw and were
told, the broker's queue and prepared branches, and the database model, at the end.

Which global transaction consumed a message for good, on the broker's side: a
message consumed for good is never delivered again, so it is the one that received
its last delivery — when the message is not left in the queue at the end (those
left are received once more at the end to name them) and no branch still holds one.
On the database's side: the model records every branch's outcome
(:attr:`~txbroker.sim.pg_model.PgDatabase.outcomes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from txbroker.sim.pg_model import PgDatabase


@dataclass
class XaRecord:
    """What the workers saw and were told, and what was left at the end."""

    #: (global id, message id) of every delivery a worker received in a transaction
    deliveries: list[tuple[str, str]] = field(default_factory=list)
    #: global id -> "committed", "rolled back" or "unknown": what commit/rollback said
    told: dict[str, str] = field(default_factory=dict)
    #: what went wrong outside the checkers' view
    failures: list[str] = field(default_factory=list)
    #: at the end: messages in the queue, prepared branches (global ids) in each
    left_in_queue: int = -1
    left_ids: set[str] = field(default_factory=set)  #: those of them not held by a branch
    broker_prepared: list[str] = field(default_factory=list)
    pg_prepared: list[str] = field(default_factory=list)
    #: virtual time the manager's last recovery came out clean (None: it did not)
    final_recovery: float | None = None


def check_xa(record: XaRecord, db: PgDatabase, messages: int) -> list[str]:
    """The violations of one run (see the module docstring of ``live_xa.py``)."""
    violations = list(record.failures)
    if "committed" not in record.told.values():
        violations.append("no global transaction committed: the run tested nothing")
    if record.final_recovery is None:
        violations.append("the manager's last recovery did not come out clean in the "
                          "healed phase")
    if record.left_in_queue != 0:
        violations.append(f"{record.left_in_queue} messages left in the queue after the "
                          "healed phase")
    violations.extend(f"branch {g} still prepared in the broker after the healed phase"
                      for g in record.broker_prepared)
    violations.extend(f"branch {g} still prepared in the database after the healed phase"
                      for g in record.pg_prepared)
    expected = {f"m{n}" for n in range(messages)}
    violations.extend(f"{m}: no row committed (lost, or never consumed)"
                      for m in sorted(expected - set(db.rows)))
    violations.extend(f"row {m} committed for a message never sent"
                      for m in sorted(set(db.rows) - expected))
    last: dict[str, str] = {}  # message -> the global id of its last delivery
    message_of: dict[str, str] = {}
    for gtrid, message_id in record.deliveries:
        last[message_id] = gtrid
        message_of[gtrid] = message_id
    # a message still in the queue is not consumed; one held by a branch left prepared
    # (or suspended, when some are held) has no broker outcome yet
    held = len(record.left_ids) < record.left_in_queue
    undecided = set(record.broker_prepared)
    committed_by: dict[str, list[str]] = {}
    for gtrid, message_id in message_of.items():
        broker: bool | None = (last[message_id] == gtrid
                               and message_id not in record.left_ids)
        if held or last[message_id] in undecided:
            broker = None
        pg = db.outcomes.get(gtrid) == "committed"
        if pg:
            committed_by.setdefault(message_id, []).append(gtrid)
        if broker is not None and broker != pg:
            violations.append(
                f"{gtrid[:8]} ({message_id}): the broker "
                f"{'consumed it for good' if broker else 'did not consume it'} but the "
                f"database {'committed' if pg else 'did not commit'} its row")
        told = record.told.get(gtrid)
        if told == "committed" and not (pg and broker is not False):
            violations.append(f"{gtrid[:8]} ({message_id}): told committed, but "
                              f"database {db.outcomes.get(gtrid)}, broker {broker}")
        if told == "rolled back" and (pg or broker):
            violations.append(f"{gtrid[:8]} ({message_id}): told rolled back, but "
                              f"database {db.outcomes.get(gtrid)}, broker {broker}")
    for message_id, gtrids in sorted(committed_by.items()):
        if len(gtrids) > 1:
            violations.append(f"{message_id} consumed twice: {gtrids}")
        if db.rows.get(message_id) not in gtrids:
            violations.append(f"row {message_id} holds {db.rows.get(message_id)}, not the "
                              f"transaction that committed it ({gtrids})")
    return violations

"""The transaction manager: global transactions over txbroker and PostgreSQL.

::

    from txbroker.tm import TransactionManager, BrokerParticipant, PostgresParticipant

    tm = TransactionManager("tm.log")
    broker, db = BrokerParticipant(conn), PostgresParticipant(pg)
    with tm.begin([broker, db]):
        msg = conn.receive("orders", timeout=5); msg.ack()
        pg.execute("INSERT INTO orders VALUES (%s)", (msg.body,))
    # both committed, or neither

After a crash, :func:`recover` with the same log and a resource per resource
manager (``BrokerResource``, ``PostgresResource``) finishes what was decided.
:mod:`txbroker.tm.aio` is the asyncio form (many global transactions in flight on
one event loop, one decision-log sync per batch of them). See docs/tm.md.
"""

from txbroker.tm.log import DecisionLog
from txbroker.tm.manager import (
    STEPS,
    GlobalTransaction,
    InDoubt,
    RolledBack,
    TMError,
    TransactionManager,
)
from txbroker.tm.participants import (
    TM_FORMAT_ID,
    BrokerParticipant,
    BrokerResource,
    Participant,
    PostgresParticipant,
    PostgresResource,
    Resource,
    branch_xid,
)
from txbroker.tm.recovery import RecoveryReport, recover

__all__ = [
    "STEPS",
    "TM_FORMAT_ID",
    "BrokerParticipant",
    "BrokerResource",
    "DecisionLog",
    "GlobalTransaction",
    "InDoubt",
    "Participant",
    "PostgresParticipant",
    "PostgresResource",
    "RecoveryReport",
    "Resource",
    "RolledBack",
    "TMError",
    "TransactionManager",
    "branch_xid",
    "recover",
]

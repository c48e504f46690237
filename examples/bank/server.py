"""The bank's router server for one partition: applies transfer legs to its database.

    python -m examples.bank.server --url txb://127.0.0.1:5445 --partition A \\
        --dsn "host=127.0.0.1 port=5432 user=postgres dbname=postgres" [--role standby]
        [--explicit-prepare] [--handler] [--log server-a.log]

It follows the seed's Table 4-7 (polling model) exactly::

    1. Receive(MSG1)            a new transaction (UNCERTAIN: a replay, see below)
    2. SQL update               the leg, and the tid in the TID table ``applied``,
                                in one SQL transaction that stays open
    3. AcceptTransaction        vote (RejectTransaction "INSUFFICIENT" if the debit
                                would overdraw the account; the SQL is rolled back)
    4. Receive(ACCEPTED)        the router's decision
    5. SQL commit               (REJECTED: SQL rollback)
    6. AcknowledgeTransactionOutcome

Replay safety: a transaction replayed with ``UNCERTAIN`` as its first message may
already be committed here (the server died between steps 5 and 6): the server
looks the tid up in ``applied`` and, if it is there, skips the work and only
votes again. A replay of a transaction the router already decided ACCEPTED
(``message.decided``) is applied without the balance check: the check was made
when the transfer was voted, the other side commits, and refusing now would
apply the transfer on one side only. ``--handler`` runs the same logic as a ``ServerMessageHandler``
(the event-driven column of Table 4-7).

Crash points for the tests, from the environment: ``BANK_CRASH_AT=POINT:N``
kills this process with SIGKILL at POINT of its N-th transaction (counting the
first messages it received): ``before_vote`` (between steps 2 and 3),
``after_vote`` (step 4 received ACCEPTED, before 5), ``after_commit`` (between 5
and 6; the first accepted transaction from the N-th on for these two) and
``after_receive`` (the receive that starts transaction N+1 returned: after 6).
A ``POISON_AMOUNT=M`` environment variable makes the server kill itself on any
leg whose amount is M (the poison transaction of tests/router/test_poison.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import psycopg

from examples.bank.bank import FACILITY, INSUFFICIENT, PARTITIONS, Leg, database_dsn, open_server

#: Seconds one receive() waits before the loop looks at its stop conditions again.
RECEIVE_TIMEOUT = 1.0
#: PostgreSQL waits at most this long for a row lock (two servers of a partition
#: touching one account); the leg is then refused with reason "BUSY".
LOCK_TIMEOUT = "2s"
CRASH_POINTS = ("before_vote", "after_vote", "after_commit", "after_receive")


def kind(message: Any) -> str:
    """A received message's type as its name: MSG1, MSG, PREPARE, ACCEPTED …"""
    value = message.type
    return str(getattr(value, "name", value)).upper()


class Journal:
    """The server's own log of what it did, one line per step, flushed at once (so
    that a test can read it after a kill -9)."""

    def __init__(self, path: Path | None) -> None:
        self.out: TextIO | None = open(path, "a") if path else None  # noqa: SIM115

    def write(self, *words: object) -> None:
        if self.out is not None:
            self.out.write(" ".join(str(w) for w in words) + "\n")
            self.out.flush()


class BankLogic:
    """The database side of one server: one SQL transaction per router transaction."""

    def __init__(self, dsn: str, name: str, journal: Journal, crash: str | None,
                 poison: int | None) -> None:
        self.pg = psycopg.connect(dsn)  # autocommit off: the SQL transaction stays open
        self.pg.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
        self.pg.commit()
        self.name, self.journal, self.poison = name, journal, poison
        point, _, nth = (crash or ":0").partition(":")
        if crash and point not in CRASH_POINTS:
            raise SystemExit(f"BANK_CRASH_AT: unknown point {point!r}")
        self.crash_point, self.crash_nth = point, int(nth or 0)
        self.count = 0  # transactions begun by this process
        self.tid: str | None = None
        self.refused: str | None = None  # the reject reason, once a leg was refused
        self.skip = False  # an UNCERTAIN replay that is already applied here

    def crash(self, point: str, tid: str | None = None) -> None:
        """Kill this process at ``point`` if the environment asked for it (``tid``: the
        transaction it dies in, when not the current one)."""
        if point == self.crash_point and self.count >= self.crash_nth:
            self.journal.write("CRASH", point, tid or self.tid, f"{time.time():.6f}")
            os.kill(os.getpid(), signal.SIGKILL)

    def begin(self, message: Any, uncertain: bool) -> None:
        """Step 1: the first message of a transaction."""
        self.pg.rollback()  # nothing is open here; be sure of it
        self.count += 1
        self.tid, self.refused, self.skip = message.tid, None, False
        replay = getattr(message, "replay", 0)
        self.journal.write("BEGIN", self.tid, "UNCERTAIN" if uncertain else "MSG1",
                           f"replay={replay}")
        if uncertain:
            row = self.pg.execute("SELECT 1 FROM applied WHERE tid = %s",
                                  (self.tid,)).fetchone()
            self.pg.rollback()
            self.skip = row is not None
            if self.skip:
                self.journal.write("SKIP", self.tid)

    def apply(self, message: Any) -> None:
        """Step 2: apply one leg and record the tid, in the open SQL transaction."""
        if self.skip or self.refused:
            return
        leg = Leg.decode(message.body)
        if self.poison is not None and abs(leg.amount) == self.poison:
            self.journal.write("POISON", self.tid, f"{time.time():.6f}")
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            if leg.amount < 0 and not getattr(message, "decided", False):
                cur = self.pg.execute("UPDATE accounts SET balance = balance + %s "
                                      "WHERE id = %s AND balance >= %s",
                                      (leg.amount, leg.account, -leg.amount))
            else:
                cur = self.pg.execute("UPDATE accounts SET balance = balance + %s "
                                      "WHERE id = %s", (leg.amount, leg.account))
            if cur.rowcount != 1:
                self.refused = INSUFFICIENT
                return
            self.pg.execute("INSERT INTO applied (tid, legs, delta, server) "
                            "VALUES (%s, 1, %s, %s) ON CONFLICT (tid) DO UPDATE SET "
                            "legs = applied.legs + 1, delta = applied.delta + EXCLUDED.delta",
                            (self.tid, leg.amount, self.name))
        except psycopg.errors.LockNotAvailable:
            self.refused = "BUSY"

    def finish(self, accepted: bool, reason: str | None = None) -> None:
        """Step 5: SQL commit on ACCEPTED, rollback on REJECTED."""
        if accepted:
            self.crash("after_vote")
            self.pg.commit()
            self.journal.write("COMMIT", self.tid, "skip" if self.skip else "")
            self.crash("after_commit")
        else:
            self.pg.rollback()
            self.journal.write("ROLLBACK", self.tid, reason)


def vote(controller: Any, logic: BankLogic) -> None:
    """Step 3: AcceptTransaction, or RejectTransaction with the refusal's reason."""
    logic.crash("before_vote")
    if logic.refused:
        logic.pg.rollback()
        logic.journal.write("VOTE", logic.tid, "reject", logic.refused)
        controller.reject_transaction(logic.refused)
    else:
        logic.journal.write("VOTE", logic.tid, "accept")
        controller.accept_transaction()


def run_polling(controller: Any, logic: BankLogic, explicit_prepare: bool) -> None:
    """The polling model of Table 4-7."""
    voted_reject = False
    while True:
        message = controller.receive(RECEIVE_TIMEOUT)
        if message is None:
            continue
        name = kind(message)
        if name in ("MSG1", "UNCERTAIN"):
            if logic.count >= 1:
                logic.crash("after_receive", message.tid)
            logic.begin(message, uncertain=name == "UNCERTAIN")
            voted_reject = False
        if name in ("MSG1", "UNCERTAIN", "MSG"):
            logic.apply(message)
            if not explicit_prepare and not voted_reject:
                vote(controller, logic)
                voted_reject = logic.refused is not None
        elif name == "PREPARE":
            if not voted_reject:
                vote(controller, logic)
                voted_reject = logic.refused is not None
        elif name in ("ACCEPTED", "REJECTED"):
            logic.finish(name == "ACCEPTED", getattr(message, "reason", None))
            controller.acknowledge_outcome()


def run_handler(controller: Any, logic: BankLogic, explicit_prepare: bool) -> None:
    """The event-driven model of Table 4-7: a ServerMessageHandler over the controller."""
    from txbroker.router import ServerMessageHandler

    class BankHandler(ServerMessageHandler):
        """The same steps, one callback per message type (the library's PLAN calls
        on_initialize or on_uncertain, then on_application_message, for a first
        message, and acknowledges the outcome after on_accepted / on_rejected)."""

        def __init__(self) -> None:
            super().__init__()
            self.voted_reject = False

        def on_initialize(self, message: Any, controller: Any) -> None:
            if logic.count >= 1:
                logic.crash("after_receive", message.tid)
            logic.begin(message, uncertain=False)
            self.voted_reject = False

        def on_uncertain(self, message: Any, controller: Any) -> None:
            logic.begin(message, uncertain=True)
            self.voted_reject = False

        def on_application_message(self, message: Any, controller: Any) -> None:
            logic.apply(message)
            if not explicit_prepare and not self.voted_reject:
                vote(controller, logic)
                self.voted_reject = logic.refused is not None

        def on_prepare(self, message: Any, controller: Any) -> None:
            if not self.voted_reject:
                vote(controller, logic)
                self.voted_reject = logic.refused is not None

        def on_accepted(self, message: Any, controller: Any) -> None:
            logic.finish(True)

        def on_rejected(self, message: Any, controller: Any) -> None:
            logic.finish(False, message.reason)

    BankHandler().run(controller)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("TXBROKER_URL",
                                                        "txb://127.0.0.1:5445"))
    parser.add_argument("--partition", choices=sorted(PARTITIONS), required=True)
    parser.add_argument("--dsn", required=True, help="the PostgreSQL server (any database)")
    parser.add_argument("--role", default="primary",
                        choices=("primary", "standby", "concurrent", "shadow"))
    parser.add_argument("--explicit-prepare", action="store_true")
    parser.add_argument("--handler", action="store_true",
                        help="the ServerMessageHandler (event-driven) model")
    parser.add_argument("--name", default=None, help="this server's name in its log lines")
    parser.add_argument("--log", type=Path, default=None)
    parser.add_argument("--facility", default=FACILITY)
    args = parser.parse_args(argv)
    poison = os.environ.get("POISON_AMOUNT")
    name = args.name or f"{args.partition}-{os.getpid()}"
    journal = Journal(args.log)
    logic = BankLogic(database_dsn(args.dsn, args.partition), name, journal,
                      os.environ.get("BANK_CRASH_AT"), int(poison) if poison else None)
    controller = open_server(args.url, args.partition, role=args.role,
                             explicit_prepare=args.explicit_prepare, facility=args.facility)
    journal.write("READY", name, os.getpid())
    print(f"bank server ready {name}", flush=True)
    run = run_handler if args.handler else run_polling
    try:
        run(controller, logic, args.explicit_prepare)
    except KeyboardInterrupt:
        pass
    finally:
        sys.stdout.flush()


if __name__ == "__main__":
    main()

"""The bank's router client: random transfers, each one router transaction.

    python -m examples.bank.client --url txb://127.0.0.1:5445 --count 500 \\
        --log transfers.log [--seed 1] [--set-accept] [--cross-only]

A transfer moves a random amount from one random account to another (0-1999, so
in partition A, B or across both): one message per leg, keyed by its account,
sent in account order (so that two servers of a partition lock rows in one
order), then ``accept()`` (or ``set_accept()`` with the last leg) and
``receive()`` for the outcome.

The log (one line each, flushed at once, so it survives a kill -9):

    START <tid> <from> <to> <amount> <unix time>   before the first message is sent
    OUTCOME <tid> ACCEPTED|REJECTED <reason> <latency ms> <unix time>
    ERROR <tid> <text>                   no outcome came (the checker asks the broker)

``BANK_CLIENT_CRASH_AT=after_send:N`` or ``after_accept:N`` kills the client with
SIGKILL after the first message, or after the accept, of its N-th transfer.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

from examples.bank.bank import FACILITY, Leg, open_client
from txbroker.errors import TxBrokerError

#: Seconds to wait for one transfer's outcome before logging it as an ERROR.
OUTCOME_TIMEOUT = 60.0
#: The largest transfer: with 100 in every account, some debits are refused.
MAX_AMOUNT = 150


def outcome_of(controller: Any, timeout: float) -> Any:
    """Receive until the transaction's outcome (skipping events)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no outcome within {timeout} s")
        try:
            message = controller.receive(left)
        except TxBrokerError:
            # a pipelined send's error raised late ("already decided": the REJECTED
            # outcome is queued behind it), or a failover under way (the library asks
            # for the outcome once registered again): keep receiving
            continue
        if message is None:
            continue
        name = str(getattr(message.type, "name", message.type)).upper()
        if name in ("ACCEPTED", "REJECTED"):
            return message


def pick(rng: random.Random, accounts: list[int], cross_only: bool) -> tuple[int, int]:
    """Two distinct accounts (in different partitions when ``cross_only``)."""
    while True:
        a, b = rng.choice(accounts), rng.choice(accounts)
        if a != b and (not cross_only or (a < 1000) != (b < 1000)):
            return a, b


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("TXBROKER_URL",
                                                        "txb://127.0.0.1:5445"))
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--set-accept", action="store_true",
                        help="send the last leg and the accept together")
    parser.add_argument("--cross-only", action="store_true",
                        help="every transfer between partition A and partition B")
    parser.add_argument("--accounts", default="0-1999",
                        help="LOW-HIGH[/STEP+OFFSET]: the accounts this client uses")
    parser.add_argument("--poison", type=int, default=None,
                        help="every transfer of this amount (the poison transaction)")
    parser.add_argument("--max-amount", type=int, default=MAX_AMOUNT,
                        help="the largest transfer (default 150: some debits are refused)")
    parser.add_argument("--facility", default=FACILITY)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    span, _, stride = args.accounts.partition("/")
    low, high = (int(x) for x in span.split("-"))
    step, offset = (int(x) for x in stride.split("+")) if stride else (1, 0)
    accounts = [k for k in range(low, high + 1) if k % step == offset]
    crash = os.environ.get("BANK_CLIENT_CRASH_AT", "")
    crash_point, _, crash_nth = crash.partition(":")
    log = open(args.log, "a")  # noqa: SIM115 - one line per step, flushed

    def write(*words: object) -> None:
        log.write(" ".join(str(w) for w in words) + "\n")
        log.flush()

    controller = open_client(args.url, args.facility)
    for n in range(1, args.count + 1):
        a, b = pick(rng, accounts, args.cross_only)
        amount = args.poison or rng.randint(1, args.max_amount)
        legs = sorted([Leg(n, a, -amount), Leg(n, b, amount)], key=lambda leg: leg.account)
        tid = controller.start_transaction()
        started = time.time()
        write("START", tid, a, b, amount, f"{started:.6f}")
        try:
            try:
                for i, leg in enumerate(legs):
                    last = i == len(legs) - 1
                    if last and args.set_accept:
                        controller.set_accept(leg.encode(), key=leg.account)
                    else:
                        controller.send(leg.encode(), key=leg.account)
                    if crash_point == "after_send" and n == int(crash_nth):
                        write("CRASH after_send", tid)
                        os.kill(os.getpid(), signal.SIGKILL)
                if not args.set_accept:
                    controller.accept()
            except TxBrokerError as exc:
                # a server rejected before our accept (IllegalState: decided, REJECTED
                # is on its way), or the connection broke while sending (the library
                # delivers REJECTED LOST, or the outcome it asks for after failover)
                write("SENDFAIL", tid, type(exc).__name__, str(exc).replace("\n", " ")[:200])
            if crash_point == "after_accept" and n == int(crash_nth):
                write("CRASH after_accept", tid)
                os.kill(os.getpid(), signal.SIGKILL)
            message = outcome_of(controller, OUTCOME_TIMEOUT)
            name = str(getattr(message.type, "name", message.type)).upper()
            now = time.time()
            write("OUTCOME", tid, name, getattr(message, "reason", None) or "-",
                  f"{(now - started) * 1000:.3f}", f"{now:.6f}")
        except Exception as exc:
            write("ERROR", tid, type(exc).__name__, str(exc).replace("\n", " ")[:200])
            controller.close()  # stuck in this transaction: start over with a new one
            controller = open_client(args.url, args.facility)
    write("DONE", args.count)
    log.close()


if __name__ == "__main__":
    main()

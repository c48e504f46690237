"""Wait cycles between router transactions, and which participant makes way.

Theory of operation
-------------------
A server holds one transaction at a time (as an RTR server channel does), and a
transaction holds the servers it was presented to until its outcome. Two
transfers over partitions A and B can therefore each hold one partition's only
free server while waiting for the other's: T1 holds A and waits for B, T2
holds B and waits for A — also when both send A first, since sends are
pipelined and each message is presented as it arrives. Nobody can vote, and
before this module both waited for the vote timeout (30 s) and were rejected.

The router keeps a *waits-for* relation between undecided transactions: T
waits for U when a participant of T is WAITING for a site whose servers are all
busy, and U holds one of them. A decided transaction never waits (its held
servers are freed by their acknowledgements), so only SENDING and VREQ ones
count. After every presentation round that leaves a participant waiting,
:func:`victims` looks for a cycle; in one, the **youngest** transaction (the
largest :attr:`~txbroker.core.router.states.Transaction.seq`) makes way: each
participant of it that holds a server of the cycle is told REJECTED with reason
``PREEMPTED`` (its work rolls back, its vote is void) and is presented again —
as MSG1 — once that server acknowledged. This is wound-wait with the victim
chosen only inside a real cycle: the oldest transaction of a cycle never makes
way, so every cycle is broken and no transaction waits forever (a victim grows
older as new transactions come). Nothing is journaled: a preempted participant
has not voted in anything that counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from txbroker.core.router.states import Controller, Participant, PartState, Transaction, TxState

#: The states of a participant that holds its server and can still make way.
PREEMPTIBLE = (PartState.RECEIVING, PartState.VOTING, PartState.VOTED)

Candidates = Callable[[Participant], list[Controller]]


def waits_for(waiting: Iterable[Participant], candidates: Candidates
              ) -> dict[Transaction, set[Transaction]]:
    """The waits-for relation among undecided transactions: for each transaction with
    a waiting participant whose candidate servers are all busy, the transactions
    holding those servers."""
    edges: dict[Transaction, set[Transaction]] = {}
    for participant in waiting:
        tx = participant.tx
        if participant.state is not PartState.WAITING or not _undecided(tx):
            continue
        servers = candidates(participant)
        if not servers or any(s.current is None for s in servers):
            continue  # no site (it waits for the site's return), or about to be presented
        for server in servers:
            holder = server.current
            assert holder is not None
            if holder.tx is not tx and _undecided(holder.tx):
                edges.setdefault(tx, set()).add(holder.tx)
    return edges


def victims(waiting: Iterable[Participant], candidates: Candidates) -> list[Participant]:
    """The participants that make way to break one wait cycle (none if there is no
    cycle): those of the cycle's youngest transaction that hold a server of the cycle."""
    edges = waits_for(waiting, candidates)
    cycle = _find_cycle(edges)
    if not cycle:
        return []
    youngest = max(cycle, key=lambda tx: tx.seq)
    return [p for p in youngest.participants.values()
            if p.state in PREEMPTIBLE and p.server is not None]


def _undecided(tx: Transaction) -> bool:
    return tx.state in (TxState.SENDING, TxState.VREQ)


def _find_cycle(edges: dict[Transaction, set[Transaction]]) -> list[Transaction]:
    """One cycle of the relation, as its transactions (empty if none): iterative DFS,
    the nodes and their successors in a fixed order (by age) so that the same state
    always gives the same answer."""
    done: set[Transaction] = set()
    for start in sorted(edges, key=lambda tx: tx.seq):
        if start in done:
            continue
        path: list[Transaction] = []
        on_path: set[Transaction] = set()
        stack: list[tuple[Transaction, list[Transaction]]] = [
            (start, sorted(edges.get(start, ()), key=lambda tx: tx.seq))]
        path.append(start)
        on_path.add(start)
        while stack:
            node, successors = stack[-1]
            if not successors:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
                continue
            nxt = successors.pop(0)
            if nxt in on_path:
                return path[path.index(nxt):]
            if nxt in done:
                continue
            stack.append((nxt, sorted(edges.get(nxt, ()), key=lambda tx: tx.seq)))
            path.append(nxt)
            on_path.add(nxt)
    return []


__all__ = ["PREEMPTIBLE", "victims", "waits_for"]

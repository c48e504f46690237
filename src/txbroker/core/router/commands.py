"""The router's commands: what an edge may ask of the router, one value each.

Theory of operation
-------------------
The broker core's front takes every router request as one of these values
(:meth:`Broker.rtr <txbroker.core.broker.Broker.rtr>`, the router's only door),
the way h11 takes events: the native ``rtr_*`` ops check their arguments and
build one; the simulator builds them the same way. The router
(:meth:`Router.execute <txbroker.core.router.engine.Router.execute>`) carries
each out; argument values that arrive from a client unchecked (``Any``) are
checked there (the router's errors name them). A command is a value: nothing
changes it once it is built (not ``frozen``: a frozen dataclass is built by
``object.__setattr__`` per field, which costs on the pure-Python path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

from txbroker.core.router.model import Role


@dataclass(slots=True)
class Define:
    """``rtr_define``: define (or redefine) a facility; answered once durable."""

    facility: Any
    partitions: Any


@dataclass(slots=True)
class SetPartition:
    """``rtr_set_partition``: change a partition's retry count or vote timeout."""

    facility: Any
    partition: Any
    retry_count: Any = None
    vote_timeout_ms: Any = None


@dataclass(slots=True)
class Register:
    """``rtr_register``: a client controller on a facility, or a server controller on
    one of its partitions (by name, or a key range)."""

    facility: Any
    server: bool = False
    partition: Any = None
    role: Role = Role.PRIMARY
    explicit_prepare: bool = False
    recipient: str | None = None
    events: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class Unregister:
    """``rtr_unregister``: end a registration."""

    controller: Any


@dataclass(slots=True)
class Send:
    """``rtr_send``: a client's message (``accept``: the client's accept goes with it)."""

    controller: Any
    tid: Any
    key: Any
    body: bytes
    headers: dict[str, str] | None = None
    index: int | None = None
    accept: bool = False


@dataclass(slots=True)
class Accept:
    """``rtr_accept``: the client accepts its transaction."""

    controller: Any
    tid: Any


@dataclass(slots=True)
class Reject:
    """``rtr_reject``: the client rejects its transaction."""

    controller: Any
    tid: Any
    reason: Any = "CLIENT"


@dataclass(slots=True)
class Collected:
    """``rtr_ack``: the client collected these outcomes."""

    controller: Any
    tids: Any


@dataclass(slots=True)
class Outcome:
    """``rtr_outcome``: what became of a transaction (a reconnected client asks)."""

    tid: Any
    controller: Any = None


@dataclass(slots=True)
class Vote:
    """``rtr_vote``: a server's vote (``seen``: the messages it had when it voted)."""

    controller: Any
    tid: Any
    accept: bool
    reason: Any = ""
    seen: int | None = None


@dataclass(slots=True)
class Done:
    """``rtr_done``: a server acknowledges the outcome."""

    controller: Any
    tid: Any


@dataclass(slots=True)
class UserEvent:
    """``rtr_event``: broadcast a user event."""

    controller: Any
    number: Any
    body: Any = b""
    recipient: Any = None


@dataclass(slots=True)
class Show:
    """``rtr_show``: facilities, partitions, servers and roles, transactions by state."""

    facility: Any = None


@dataclass(slots=True)
class Exceptions:
    """``rtr_exceptions``: the exception transactions (of one facility, or all)."""

    facility: Any = None


@dataclass(slots=True)
class FacilityOf:
    """The facility of a transaction the router holds (NotFound otherwise): what an
    operator's permission on an exception transaction is checked against."""

    tid: str


@dataclass(slots=True)
class CommitException:
    """``rtr_exception_commit``: commit an exception transaction by hand."""

    tid: Any


@dataclass(slots=True)
class DiscardException:
    """``rtr_exception_discard``: discard an exception transaction."""

    tid: Any


@dataclass(slots=True)
class RetireShadow:
    """``rtr_retire_shadow``: a partition's secondary site is retired (no longer
    shadowed; what was kept for it goes)."""

    facility: Any
    partition: Any


#: Every router command.
RouterCommand: TypeAlias = (Define | SetPartition | Register | Unregister | Send | Accept | Reject
                 | Collected | Outcome | Vote | Done | UserEvent | Show | Exceptions
                 | FacilityOf | CommitException | DiscardException | RetireShadow)

__all__ = ["Accept", "Collected", "CommitException", "Define", "DiscardException", "Done",
           "Exceptions", "FacilityOf", "Outcome", "Register", "Reject", "RetireShadow",
           "RouterCommand",
           "Send", "SetPartition", "Show", "Unregister", "UserEvent", "Vote"]

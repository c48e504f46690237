"""What each client operation is: its one signature, its checks, its wire arguments.

Theory of operation
-------------------
The client has several faces for the same operation: ``send`` exists on the
async and the sync connection, on the async and the sync transaction, and as
``send_nowait`` on both connections; ``receive`` and ``send_batch`` likewise.
Written out by hand, those copies drifted (the transactional ``send`` lost the
client-side size check). So each operation is defined here ONCE:

* a *builder* — :func:`send_request`, :func:`batch_request`,
  :func:`receive_request` — whose signature IS the operation's public
  signature, which checks the arguments (TypeError for a wrong type,
  ValueError for a negative duration, the broker's own :class:`BadRequest`
  for a value the broker would refuse) and returns a frozen request object;
* the request's :meth:`~Operation.check` against the limits the broker
  announced in ``hello`` (:class:`BrokerLimits`): a body above
  ``max_message_size`` raises :class:`MessageTooLarge` without a round trip;
* the request's ``wire_args`` — the arguments of the native request
  (docs/protocol.md), defaults left out.

A face is then written as a method taking the built request, decorated with
the operation's :class:`Face` (``@send_face``). The decorator gives the method
the builder's signature (for callers, ``inspect.signature`` and mypy alike)
and runs the builder and the limit check before the method body: no face can
skip a check or grow a parameter the others lack.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Final, Generic, ParamSpec, Protocol, TypeVar, cast

from txbroker.errors import BadRequest, MessageTooLarge

__all__ = [
    "DEFAULT_PRIORITY",
    "MAX_PRIORITY",
    "BatchRequest",
    "BrokerLimits",
    "Face",
    "HasLimits",
    "Operation",
    "ReceiveRequest",
    "SendRequest",
    "batch_face",
    "batch_request",
    "millis",
    "receive_face",
    "receive_request",
    "send_face",
    "send_request",
    "settle_args",
]

#: The priority of a message sent without one (docs/protocol.md: ``priority?: int 0–9 = 4``).
DEFAULT_PRIORITY: Final = 4
#: The highest priority (docs/protocol.md: priorities are 0 to 9).
MAX_PRIORITY: Final = 9

#: What a message body may be (msgpack sends each as ``bin``).
Body = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class BrokerLimits:
    """The limits the broker announced in its ``hello`` reply (None: not announced)."""

    max_message_size: int | None = None

    @classmethod
    def from_hello(cls, info: dict[str, Any]) -> BrokerLimits:
        """The limits of a ``hello`` reply (unknown or malformed values are ignored)."""
        size = info.get("max_message_size")
        return cls(size if type(size) is int and size > 0 else None)

    def check_body(self, size: int) -> None:
        """Raise MessageTooLarge if a body of ``size`` bytes is above ``max_message_size``.

        The message is the broker's own (``core/engine.py``), so a caller sees
        the same error whichever side refused the body."""
        limit = self.max_message_size
        if limit is not None and size > limit:
            raise MessageTooLarge(f"message of {size} bytes is above max_message_size ({limit})")


#: A connection that has not said hello yet knows no limit.
NO_LIMITS: Final = BrokerLimits()


class HasLimits(Protocol):
    """What a face of the client offers its operations: the broker's announced limits."""

    def _limits(self) -> BrokerLimits:
        """The limits of the broker this face talks to."""
        ...


class Operation(Protocol):
    """A built request: checked against the broker's limits before it is sent."""

    def check(self, limits: BrokerLimits) -> None:
        """Raise the broker's error if the request is above one of ``limits``."""
        ...


# ------------------------------------------------------------------ checks


def _check_type(name: str, value: object, kind: type | tuple[type, ...]) -> None:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        names = " or ".join(k.__name__ for k in kinds)
        raise TypeError(f"{name} must be {names}, not {type(value).__name__}")


def _body_size(name: str, body: object) -> int:
    if type(body) is bytes or type(body) is bytearray:
        return len(body)
    if isinstance(body, memoryview):
        return body.nbytes
    if isinstance(body, bytes | bytearray):
        return len(body)
    raise TypeError(f"{name} must be bytes, not {type(body).__name__}")


def _check_headers(name: str, headers: object) -> None:
    if not isinstance(headers, dict):
        raise TypeError(f"{name} must be a dict of str to str, not {type(headers).__name__}")
    for key, value in headers.items():  # (a loop: cheaper than all() on a few items)
        if type(key) is not str or type(value) is not str:
            raise TypeError(f"{name} must be a dict of str to str: {key!r}: {value!r}")


def millis(name: str, seconds: float | None) -> int | None:
    """Seconds (None: not given) as whole milliseconds; ValueError if negative."""
    if seconds is None:
        return None
    if type(seconds) is not float and type(seconds) is not int:
        _check_type(name, seconds, (int, float))
    if seconds < 0:
        raise ValueError(f"{name} must be >= 0 seconds")
    return round(seconds * 1000)


# -------------------------------------------------------------------- send


# Requests are not frozen dataclasses: those take microseconds to build (each field is
# set with object.__setattr__), which a pipelined send would pay per message. They are
# not changed after they are built.


@dataclass(slots=True)
class SendRequest:
    """One checked ``send``: what :func:`send_request` built (durations in ms)."""

    dest: str
    body: Body
    body_size: int
    headers: dict[str, str] | None
    message_id: str | None
    persistent: bool
    priority: int
    ttl_ms: int | None
    delay_ms: int | None

    @property
    def resendable(self) -> bool:
        """True when the send may be sent again after a failover (the broker drops the
        duplicate of a send with a ``message_id``)."""
        return self.message_id is not None

    def check(self, limits: BrokerLimits) -> None:
        """MessageTooLarge if the body is above the broker's ``max_message_size``."""
        limit = limits.max_message_size
        if limit is not None and self.body_size > limit:
            limits.check_body(self.body_size)

    def wire_args(self, tx: int | None = None) -> dict[str, Any]:
        """The ``send`` request's arguments (defaults left out), in transaction ``tx``."""
        args: dict[str, Any] = {"dest": self.dest, "body": self.body}
        if self.headers:
            args["headers"] = self.headers
        if self.message_id is not None:
            args["message_id"] = self.message_id
        if not self.persistent:
            args["persistent"] = False
        if self.priority != DEFAULT_PRIORITY:
            args["priority"] = self.priority
        if self.ttl_ms is not None:
            args["ttl_ms"] = self.ttl_ms
        if self.delay_ms is not None:
            args["delay_ms"] = self.delay_ms
        if tx is not None:
            args["tx"] = tx
        return args


def send_request(
    dest: str,
    body: bytes,
    *,
    headers: dict[str, str] | None = None,
    message_id: str | None = None,
    persistent: bool = True,
    priority: int = DEFAULT_PRIORITY,
    ttl: float | None = None,
    delay: float | None = None,
) -> SendRequest:
    """THE signature of every ``send`` (connection, transaction, sync, async, nowait).

    ``dest`` is a queue or topic; ``body`` bytes (bytearray and memoryview are
    accepted); ``headers`` a dict of str to str; ``message_id`` enables the
    broker's duplicate detection (and a re-send after a failover);
    ``persistent=False`` keeps the message in memory only; ``priority`` is 0
    (lowest) to 9; ``ttl`` and ``delay`` are in seconds.

    Raises TypeError for a wrong type, ValueError for a negative ``ttl`` or
    ``delay``, BadRequest for a priority outside 0–9 (as the broker would).
    """
    # (``type(x) is`` first: the common case costs no function call)
    if type(dest) is not str:
        _check_type("dest", dest, str)
    size = len(body) if type(body) is bytes else _body_size("a message body", body)
    if headers is not None:
        _check_headers("headers", headers)
    if message_id is not None and type(message_id) is not str:
        _check_type("message_id", message_id, str)
    if type(persistent) is not bool:
        _check_type("persistent", persistent, bool)
    if type(priority) is not int:
        _check_type("priority", priority, int)
    if not 0 <= priority <= MAX_PRIORITY:
        raise BadRequest(f"priority must be 0 to {MAX_PRIORITY}")
    return SendRequest(
        dest, body, size, headers, message_id, persistent, priority,
        None if ttl is None else millis("ttl", ttl),
        None if delay is None else millis("delay", delay),
    )


# -------------------------------------------------------------- send_batch


@dataclass(slots=True)
class BatchRequest:
    """One checked ``send_batch``: what :func:`batch_request` built."""

    dest: str
    bodies: Sequence[Body]
    sizes: list[int]
    headers: list[dict[str, str] | None] | None
    message_ids: list[str | None] | None
    persistent: bool

    def check(self, limits: BrokerLimits) -> None:
        """MessageTooLarge if any body is above ``max_message_size`` (nothing is sent)."""
        limit = limits.max_message_size
        if limit is not None and self.sizes and max(self.sizes) > limit:
            index = next(i for i, size in enumerate(self.sizes) if size > limit)
            raise MessageTooLarge(f"bodies[{index}] is {self.sizes[index]} bytes, above "
                                  f"max_message_size ({limit}); nothing was sent")

    def wire_args(self) -> dict[str, Any]:
        """The ``send_batch`` request's arguments (defaults left out)."""
        args: dict[str, Any] = {"dest": self.dest, "bodies": self.bodies}
        if self.headers is not None:
            args["headers"] = self.headers
        if self.message_ids is not None:
            args["message_ids"] = self.message_ids
        if not self.persistent:
            args["persistent"] = False
        return args


def batch_request(
    dest: str,
    bodies: Sequence[bytes],
    *,
    headers: Sequence[dict[str, str] | None] | None = None,
    message_ids: Sequence[str | None] | None = None,
    persistent: bool = True,
) -> BatchRequest:
    """THE signature of every ``send_batch``: many messages to one destination.

    ``headers`` and ``message_ids``, when given, are lists as long as
    ``bodies`` (None for a message without). Checked here: the types of
    ``dest``, of each body, header map and id, and the lengths (BadRequest, as
    the broker would). The *contents* of each header map (str to str) are left
    to the broker: a Python loop over them would cost the Spark sink about 1 s
    per million messages.
    """
    _check_type("dest", dest, str)
    body_list = list(bodies)
    if set(map(type, body_list)) <= {bytes}:  # the common case, without a Python loop
        sizes = list(map(len, body_list))
    else:
        sizes = [_body_size(f"bodies[{i}]", body) for i, body in enumerate(body_list)]
    header_list = None if headers is None else list(headers)
    if header_list is not None:
        _check_items("headers", header_list, dict, len(body_list))
    id_list = None if message_ids is None else list(message_ids)
    if id_list is not None:
        _check_items("message_ids", id_list, str, len(body_list))
    _check_type("persistent", persistent, bool)
    return BatchRequest(dest, body_list, sizes, header_list, id_list, persistent)


def _check_items(name: str, values: list[Any], kind: type, count: int) -> None:
    """Each of ``values`` is a ``kind`` or None, and there are ``count`` of them."""
    if not set(map(type, values)) <= {kind, type(None)}:  # else: subclasses, or a wrong type
        for index, value in enumerate(values):
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"{name}[{index}] must be {kind.__name__} or None, "
                                f"not {type(value).__name__}")
    if len(values) != count:
        raise BadRequest(f"{name} must be a list as long as bodies")


# ----------------------------------------------------------------- receive


@dataclass(slots=True)
class ReceiveRequest:
    """One checked ``receive``: what :func:`receive_request` built."""

    queue: str
    timeout_ms: int | None  #: None: wait for a message forever

    def check(self, limits: BrokerLimits) -> None:
        """Nothing of a receive depends on the broker's limits."""

    def wire_args(self) -> dict[str, Any]:
        """The ``receive`` request's arguments."""
        if self.timeout_ms is None:
            return {"queue": self.queue}
        return {"queue": self.queue, "timeout_ms": self.timeout_ms}

    def reply_timeout(self, request_timeout: float | None) -> float | None:
        """Seconds to wait for the reply: the receive's own wait plus the connection's
        request ``timeout`` (None: forever)."""
        if self.timeout_ms is None or request_timeout is None:
            return None
        return self.timeout_ms / 1000 + request_timeout


def receive_request(queue: str, timeout: float | None = None) -> ReceiveRequest:
    """THE signature of every ``receive``: take one message of ``queue``.

    ``timeout`` is in seconds: None waits forever, 0 only polls; ValueError if
    negative.
    """
    _check_type("queue", queue, str)
    return ReceiveRequest(queue, millis("timeout", timeout))


# ----------------------------------------------------------------- ack/nack


def settle_args(
    tags: list[int], *, requeue: bool = True, tx: int | None = None
) -> dict[str, Any]:
    """The arguments of an ``ack`` or ``nack`` request (``requeue`` is nack's, defaults
    left out), in transaction ``tx``."""
    args: dict[str, Any] = {"tags": tags}
    if not requeue:
        args["requeue"] = False
    if tx is not None:
        args["tx"] = tx
    return args


# -------------------------------------------------------------------- faces

P = ParamSpec("P")
Q = TypeVar("Q", bound=Operation)
S = TypeVar("S", bound=HasLimits)
R = TypeVar("R")


class Face(Generic[P, Q]):
    """Makes a method a face of one operation: ``@send_face`` on ``def send(self, request)``.

    The decorated method takes the builder's parameters (its ``inspect.signature``
    and its type are the builder's, with ``self`` first); a call builds the request,
    checks it against ``self._limits()`` and passes it to the method's body. A
    coroutine function stays one: its checks then run when it is awaited, as any
    coroutine's code does.
    """

    def __init__(self, build: Callable[P, Q]) -> None:
        self.build = build
        self.parameters = list(inspect.signature(build).parameters.values())

    def __call__(self, body: Callable[[S, Q], R]) -> Callable[Concatenate[S, P], R]:
        """Decorate ``body(self, request)``."""
        build = self.build
        method: Callable[..., Any]
        if inspect.iscoroutinefunction(body):
            async_body = cast(Callable[[S, Q], Awaitable[Any]], body)

            async def method(self: S, /, *args: Any, **kwargs: Any) -> Any:
                request = build(*args, **kwargs)
                request.check(self._limits())
                return await async_body(self, request)

        else:

            def method(self: S, /, *args: Any, **kwargs: Any) -> Any:
                request = build(*args, **kwargs)
                request.check(self._limits())
                return body(self, request)

        face: Any = functools.update_wrapper(method, body)
        del face.__wrapped__  # its signature is the builder's, not the body's
        returns = inspect.signature(body).return_annotation
        self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
        face.__signature__ = inspect.Signature(
            [self_parameter, *self.parameters], return_annotation=returns
        )
        face.__annotations__ = {
            **{name: value for name, value in self.build.__annotations__.items()
               if name != "return"},
            "return": returns,
        }
        return cast(Callable[Concatenate[S, P], R], face)


#: The face of ``send`` (every face of it has :func:`send_request`'s signature).
send_face: Final = Face(send_request)
#: The face of ``send_batch`` (:func:`batch_request`'s signature).
batch_face: Final = Face(batch_request)
#: The face of ``receive`` (:func:`receive_request`'s signature).
receive_face: Final = Face(receive_request)

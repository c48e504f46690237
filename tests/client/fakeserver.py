"""A small in-process broker speaking docs/protocol.md, built on the native codec.

Just enough for the client tests: hello, send (dedup by message_id, topics,
quotas), receive, subscribe + deliver with prefetch credit, ack/nack,
transactions, queue ops. State lives in a :class:`FakeBroker` that several
:class:`FakeServer` listeners may share (like brokers on a shared store), so
that killing one and moving to the other keeps the messages.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from txbroker.errors import ErrorCode, ProtocolError
from txbroker.protocol.native import Err, NativeConnection, Ok, Push, Request, Role, encode_error

_NO_REPLY: Any = object()


class Refused(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class FMessage:
    seq: int
    queue: str
    body: bytes
    headers: dict[str, str]
    message_id: str | None
    priority: int
    timestamp_ms: int
    delivery_count: int = 0
    redelivered: bool = False


@dataclass
class FSub:
    conn: FakeConnection
    sub_id: int
    queue: str
    prefetch: int
    auto: bool
    unacked: int = 0


@dataclass
class FQueue:
    name: str
    kind: str = "queue"
    settings: dict[str, Any] = field(default_factory=dict)
    ready: list[tuple[int, int, FMessage]] = field(default_factory=list)
    subs: list[FSub] = field(default_factory=list)
    waiters: list[tuple[FakeConnection, int, asyncio.TimerHandle | None]] = field(
        default_factory=list
    )
    dup_ids: set[str] = field(default_factory=set)
    topic_subs: list[str] = field(default_factory=list)

    def push(self, message: FMessage) -> None:
        heapq.heappush(self.ready, (-message.priority, message.seq, message))

    def info(self, in_flight: int = 0) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "depth": len(self.ready),
            "in_flight": in_flight,
            "consumers": len(self.subs),
            "bytes": sum(len(m.body) for _, _, m in self.ready),
            "scheduled": 0,
            "settings": dict(self.settings),
        }


@dataclass
class FTx:
    sends: list[dict[str, Any]] = field(default_factory=list)
    acks: list[tuple[FQueue, FMessage, FSub | None]] = field(default_factory=list)


class FakeBroker:
    """Queues and messages, shared by the listeners that serve them."""

    def __init__(self, users: dict[str, str] | None = None) -> None:
        self.users = users
        self.queues: dict[str, FQueue] = {}
        self.seq = itertools.count(1)
        self.tx_ids = itertools.count(1)
        self.sessions = itertools.count(1)
        self.connections: set[FakeConnection] = set()
        self.fail_commits = False
        self.log: list[tuple[str, dict[str, Any]]] = []

    def queue(self, name: str, create: bool = True) -> FQueue:
        queue = self.queues.get(name)
        if queue is None:
            if not create:
                raise Refused(ErrorCode.NOT_FOUND, f"no queue {name!r}")
            queue = self.queues[name] = FQueue(name)
        return queue

    def in_flight(self, name: str) -> int:
        return sum(1 for c in self.connections for q, _, _ in c.inflight.values() if q.name == name)

    def enqueue(self, args: dict[str, Any]) -> bool:
        """Store a message; return True if it is a duplicate."""
        queue = self.queue(args["dest"])
        message_id = args.get("message_id")
        if message_id is not None:
            if message_id in queue.dup_ids:
                return True
            queue.dup_ids.add(message_id)
        targets = [self.queue(n) for n in queue.topic_subs] if queue.kind == "topic" else [queue]
        for target in targets:
            limit = target.settings.get("max_messages", 0)
            if limit and len(target.ready) >= limit:
                raise Refused(ErrorCode.QUOTA_EXCEEDED, f"queue {target.name!r} is full")
        for target in targets:
            target.push(
                FMessage(
                    seq=next(self.seq),
                    queue=target.name,
                    body=bytes(args["body"]),
                    headers=dict(args.get("headers") or {}),
                    message_id=message_id,
                    priority=int(args.get("priority", 4)),
                    timestamp_ms=int(time.time() * 1000),
                )
            )
            self.pump(target)
        return False

    def requeue(self, queue: FQueue, message: FMessage, sub: FSub | None) -> None:
        message.redelivered = True
        if sub is not None and not sub.auto:
            sub.unacked -= 1
        if queue.name in self.queues:
            queue.push(message)
            self.pump(queue)
        if sub is not None:
            self.pump(self.queues.get(sub.queue, queue))

    def pump(self, queue: FQueue) -> None:
        """Hand ready messages to waiting receives, then to subscriptions with credit."""
        while queue.ready:
            if queue.waiters:
                conn, rid, timer = queue.waiters.pop(0)
                if timer is not None:
                    timer.cancel()
                _, _, message = heapq.heappop(queue.ready)
                conn.deliver(queue, message, rid=rid)
                continue
            ready = [s for s in queue.subs if s.auto or s.unacked < s.prefetch]
            if not ready:
                return
            for sub in ready:
                if not queue.ready:
                    return
                if not sub.auto and sub.unacked >= sub.prefetch:
                    continue
                _, _, message = heapq.heappop(queue.ready)
                sub.conn.deliver(queue, message, sub=sub)


class FakeConnection:
    """One client connection served by a FakeServer."""

    def __init__(self, server: FakeServer, writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.broker = server.broker
        self.writer = writer
        self.codec = NativeConnection(Role.SERVER)
        self.authenticated = False
        self.tags = itertools.count(1)
        self.inflight: dict[int, tuple[FQueue, FMessage, FSub | None]] = {}
        self.subs: dict[int, FSub] = {}
        self.txs: dict[int, FTx] = {}

    def write(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)

    def deliver(
        self, queue: FQueue, message: FMessage, rid: int = 0, sub: FSub | None = None
    ) -> None:
        message.delivery_count += 1
        tag = next(self.tags)
        data = {
            "tag": tag,
            "queue": queue.name,
            "body": message.body,
            "headers": message.headers,
            "message_id": message.message_id,
            "redelivered": message.redelivered,
            "delivery_count": message.delivery_count,
            "priority": message.priority,
            "timestamp_ms": message.timestamp_ms,
            "seq": message.seq,
        }
        if sub is None:
            self.inflight[tag] = (queue, message, None)
            self.write(self.codec.send(Ok(rid, data)))
            return
        if not sub.auto:
            sub.unacked += 1
            self.inflight[tag] = (queue, message, sub)
        self.write(self.codec.send(Push("deliver", {**data, "sub": sub.sub_id})))

    def lost(self) -> None:
        """The connection ended: give back everything it held."""
        self.broker.connections.discard(self)
        for queue in self.broker.queues.values():
            queue.subs = [s for s in queue.subs if s.conn is not self]
            for waiter in [w for w in queue.waiters if w[0] is self]:
                queue.waiters.remove(waiter)
                if waiter[2] is not None:
                    waiter[2].cancel()
        held = list(self.inflight.values())
        for tx in self.txs.values():
            held.extend(tx.acks)
        self.inflight.clear()
        self.txs.clear()
        for queue, message, _ in held:
            self.broker.requeue(queue, message, None)

    # ------------------------------------------------------------- requests

    def handle(self, request: Request) -> None:
        self.broker.log.append((request.op, request.args))
        try:
            if not self.authenticated and request.op != "hello":
                raise Refused(ErrorCode.NOT_AUTHENTICATED, "hello first")
            handler = getattr(self, "op_" + request.op, None)
            if handler is None:
                raise Refused(ErrorCode.UNKNOWN_OP, f"unknown op {request.op!r}")
            try:
                result = handler(request.rid, request.args)
            except (KeyError, TypeError, ValueError) as exc:
                raise Refused(ErrorCode.BAD_REQUEST, f"bad arguments: {exc!r}") from exc
        except Refused as exc:
            if request.rid:
                self.write(self.codec.send(Err(request.rid, exc.code, str(exc))))
            else:
                self.write(
                    self.codec.send(Push("error", {"code": int(exc.code), "message": str(exc)}))
                )
            return
        if result is not _NO_REPLY and request.rid and request.op not in self.server.hold_ops:
            self.write(self.codec.send(Ok(request.rid, result)))

    def op_hello(self, rid: int, args: dict[str, Any]) -> Any:
        refusal = self.server.refuse_hello
        if refusal is not None:  # a standby (or a stopping broker): refuse, then close
            self.server.refusals += 1
            self.write(self.codec.send(Err(rid, refusal, REFUSALS[refusal])))
            self.writer.close()
            return _NO_REPLY
        users = self.broker.users
        if users is not None and users.get(args.get("user", "")) != args.get("password"):
            raise Refused(ErrorCode.AUTHENTICATION_FAILED, "wrong user or password")
        self.authenticated = True
        self.server.hellos.append(args)
        return {
            "server": "txbroker",
            "version": 1,
            "session": next(self.broker.sessions),
            "max_frame_size": 1024 * 1024,
            "max_message_size": 512 * 1024,
        }

    def op_ping(self, rid: int, args: dict[str, Any]) -> Any:
        return {}

    def op_send(self, rid: int, args: dict[str, Any]) -> Any:
        if not isinstance(args["dest"], str) or not isinstance(args["body"], bytes):
            raise TypeError("dest must be str and body bin")
        if not 0 <= int(args.get("priority", 4)) <= 9:
            raise ValueError("priority must be 0-9")
        if "tx" in args:
            self.tx(args["tx"]).sends.append(args)
            return {"duplicate": False}
        return {"duplicate": self.broker.enqueue(args)}

    def op_send_batch(self, rid: int, args: dict[str, Any]) -> Any:
        """Many bodies to one destination; like the real broker's, all or nothing
        (duplicates by message id are not stored, and not counted)."""
        bodies = args["bodies"]
        if not isinstance(args["dest"], str) or not all(isinstance(b, bytes) for b in bodies):
            raise TypeError("dest must be str and bodies bin")
        headers = args.get("headers") or [None] * len(bodies)
        ids = args.get("message_ids") or [None] * len(bodies)
        queue = self.broker.queue(args["dest"])
        limit = queue.settings.get("max_messages", 0)
        if limit and len(queue.ready) + len(bodies) > limit:
            raise Refused(ErrorCode.QUOTA_EXCEEDED, f"queue {queue.name!r} is full")
        stored = 0
        for body, header, message_id in zip(bodies, headers, ids, strict=True):
            one: dict[str, Any] = {"dest": args["dest"], "body": body}
            if header is not None:
                one["headers"] = header
            if message_id is not None:
                one["message_id"] = message_id
            stored += not self.broker.enqueue(one)
        return {"count": stored}

    def op_subscribe(self, rid: int, args: dict[str, Any]) -> Any:
        sub_id = int(args["sub"])
        if sub_id in self.subs:
            raise Refused(ErrorCode.ALREADY_EXISTS, f"subscription {sub_id} exists")
        queue = self.broker.queue(args["queue"])
        sub = FSub(
            self, sub_id, queue.name, int(args.get("prefetch", 100)), args.get("ack") == "auto"
        )
        self.subs[sub_id] = sub
        queue.subs.append(sub)
        if "subscribe" not in self.server.hold_ops:  # the reply goes before the first delivery
            self.write(self.codec.send(Ok(rid, {})))
        self.broker.pump(queue)
        return _NO_REPLY

    def op_unsubscribe(self, rid: int, args: dict[str, Any]) -> Any:
        sub = self.subs.pop(int(args["sub"]), None)
        if sub is None:
            raise Refused(ErrorCode.NOT_FOUND, "no such subscription")
        queue = self.broker.queue(sub.queue)
        queue.subs.remove(sub)
        for tag, (q, message, s) in list(self.inflight.items()):
            if s is sub:
                del self.inflight[tag]
                self.broker.requeue(q, message, None)
        return {}

    def op_receive(self, rid: int, args: dict[str, Any]) -> Any:
        queue = self.broker.queue(args["queue"])
        timeout_ms = args.get("timeout_ms")
        if not queue.ready and timeout_ms == 0:
            return None
        timer = None
        if timeout_ms is not None and timeout_ms > 0:

            def expire() -> None:
                for waiter in queue.waiters:
                    if waiter[1] == rid and waiter[0] is self:
                        queue.waiters.remove(waiter)
                        self.write(self.codec.send(Ok(rid, None)))
                        return

            timer = asyncio.get_running_loop().call_later(timeout_ms / 1000, expire)
        queue.waiters.append((self, rid, timer))
        self.broker.pump(queue)
        return _NO_REPLY

    def _take(self, tags: list[int]) -> list[tuple[FQueue, FMessage, FSub | None]]:
        missing = [t for t in tags if t not in self.inflight]
        if missing:
            raise Refused(ErrorCode.ILLEGAL_STATE, f"tags {missing} are not in flight")
        return [self.inflight.pop(t) for t in tags]

    def op_ack(self, rid: int, args: dict[str, Any]) -> Any:
        if "tx" in args:
            tx = self.tx(args["tx"])
            tx.acks.extend(self._take(list(args["tags"])))
            return {}
        for queue, _, sub in self._take(list(args["tags"])):
            if sub is not None:
                sub.unacked -= 1
                self.broker.pump(queue)
        return {}

    def op_ack_by_id(self, rid: int, args: dict[str, Any]) -> Any:
        """Seed 004's ack after a failover (the real broker's rules, core/delivery.py):
        a message still ready is taken, one delivered again to this connection has
        that delivery acked; anything else is ILLEGAL_STATE."""
        queue = self.broker.queue(args["queue"])
        seq = int(args["id"])
        for tag, (_, message, _) in self.inflight.items():
            if message.seq == seq and message.queue == queue.name:
                return self.op_ack(rid, {"tags": [tag]})
        for entry in queue.ready:
            if entry[2].seq == seq:
                queue.ready.remove(entry)
                heapq.heapify(queue.ready)
                return {}
        raise Refused(ErrorCode.ILLEGAL_STATE, f"message {seq} was sent to another receiver "
                                               "or is gone")

    def op_nack(self, rid: int, args: dict[str, Any]) -> Any:
        taken = self._take(list(args["tags"]))
        for queue, message, sub in taken:
            if args.get("requeue", True):
                self.broker.requeue(queue, message, sub)
            elif sub is not None:
                sub.unacked -= 1
        return {}

    def tx(self, tx_id: Any) -> FTx:
        tx = self.txs.get(tx_id)
        if tx is None:
            raise Refused(ErrorCode.TRANSACTION, f"no transaction {tx_id!r}")
        return tx

    def op_tx_begin(self, rid: int, args: dict[str, Any]) -> Any:
        tx_id = next(self.broker.tx_ids)
        self.txs[tx_id] = FTx()
        return {"tx": tx_id}

    def op_tx_commit(self, rid: int, args: dict[str, Any]) -> Any:
        tx = self.tx(args["tx"])
        del self.txs[args["tx"]]
        if self.broker.fail_commits:
            self._undo(tx)
            raise Refused(ErrorCode.TRANSACTION_ROLLED_BACK, "commit failed")
        for send in tx.sends:
            self.broker.enqueue({k: v for k, v in send.items() if k != "tx"})
        for queue, _, sub in tx.acks:
            if sub is not None:
                sub.unacked -= 1
                self.broker.pump(queue)
        return {}

    def _undo(self, tx: FTx) -> None:
        for queue, message, sub in tx.acks:
            self.broker.requeue(queue, message, sub)

    def op_tx_rollback(self, rid: int, args: dict[str, Any]) -> Any:
        tx = self.tx(args["tx"])
        del self.txs[args["tx"]]
        self._undo(tx)
        return {}

    def op_queue_declare(self, rid: int, args: dict[str, Any]) -> Any:
        args = dict(args)
        name, kind = args.pop("name"), args.pop("kind", "queue")
        queue = self.broker.queue(name)
        queue.kind = kind
        queue.settings.update(args)
        return queue.info(self.broker.in_flight(name))

    def op_queue_update(self, rid: int, args: dict[str, Any]) -> Any:
        args = dict(args)
        queue = self.broker.queue(args.pop("name"), create=False)
        queue.settings.update(args)
        return queue.info(self.broker.in_flight(queue.name))

    def op_queue_info(self, rid: int, args: dict[str, Any]) -> Any:
        queue = self.broker.queue(args["name"], create=False)
        return queue.info(self.broker.in_flight(queue.name))

    def op_queue_list(self, rid: int, args: dict[str, Any]) -> Any:
        return [q.info(self.broker.in_flight(q.name)) for q in self.broker.queues.values()]

    def op_queue_purge(self, rid: int, args: dict[str, Any]) -> Any:
        queue = self.broker.queue(args["name"], create=False)
        purged = len(queue.ready)
        queue.ready.clear()
        return {"purged": purged}

    def op_queue_delete(self, rid: int, args: dict[str, Any]) -> Any:
        queue = self.broker.queue(args["name"], create=False)
        del self.broker.queues[queue.name]
        for sub in queue.subs:
            sub.conn.subs.pop(sub.sub_id, None)
            sub.conn.write(
                sub.conn.codec.send(Push("cancelled", {"sub": sub.sub_id, "reason": "deleted"}))
            )
        return {"deleted": len(queue.ready)}

    def op_topic_subscribe(self, rid: int, args: dict[str, Any]) -> Any:
        topic = self.broker.queue(args["topic"])
        topic.kind = "topic"
        name = f"{topic.name}::{args['name']}"
        if name not in topic.topic_subs:
            topic.topic_subs.append(name)
        return self.broker.queue(name).info()

    def op_stats(self, rid: int, args: dict[str, Any]) -> Any:
        return {"connections": len(self.broker.connections), "queues": len(self.broker.queues)}


#: What a refusing server says (as the real broker's words would read).
REFUSALS: dict[ErrorCode, str] = {
    ErrorCode.STANDBY: "this broker is the standby of an HA pair: try the active one",
    ErrorCode.SHUTTING_DOWN: "the broker is shutting down",
    ErrorCode.TOO_MANY_CONNECTIONS: "too many connections (max_connections)",
}


class FakeServer:
    """A listener on 127.0.0.1 (port 0) serving a FakeBroker.

    ``refuse_hello`` (an ErrorCode) makes it refuse every ``hello`` with that error
    and close, as a standby does; ``refuse_at_open`` makes it send that error with
    request id 0 as soon as a client connects, then close (as ``max_connections``
    does). ``refusals`` counts them."""

    def __init__(self, broker: FakeBroker | None = None) -> None:
        self.broker = broker or FakeBroker()
        self.refuse_hello: ErrorCode | None = None
        self.refuse_at_open: ErrorCode | None = None
        self.refusals = 0
        self.hold_ops: set[str] = set()  # ops whose effect happens but whose reply never comes
        self.hellos: list[dict[str, Any]] = []
        self.connections: set[FakeConnection] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> FakeServer:
        LIVE.add(self)
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        refusal = self.refuse_at_open
        if refusal is not None:
            self.refusals += 1
            writer.write(encode_error(0, int(refusal), REFUSALS[refusal]))
            writer.close()
            return
        conn = FakeConnection(self, writer)
        self.connections.add(conn)
        self.broker.connections.add(conn)
        try:
            while data := await reader.read(65536):
                conn.codec.receive_data(data)
                try:
                    while events := conn.codec.drain():
                        for event in events:
                            assert isinstance(event, Request)
                            conn.handle(event)
                except ProtocolError as exc:
                    conn.write(encode_error(0, exc.code, str(exc)))
                    break
        except (ConnectionError, OSError):
            pass
        finally:
            self.connections.discard(conn)
            conn.lost()
            writer.close()

    def drop_connections(self) -> None:
        """Cut every client connection abruptly (the listener stays)."""
        for conn in list(self.connections):
            conn.writer.transport.abort()

    async def kill(self) -> None:
        """Stop listening and cut every connection, like a crashed broker."""
        if self._server is not None:
            server, self._server = self._server, None
            server.close()
            self.drop_connections()
            await server.wait_closed()
        self.drop_connections()
        await asyncio.sleep(0)

    async def restart(self) -> None:
        """Listen again on the same port."""
        await self.start()


#: Servers started and not yet killed (closed by :func:`close_all`).
LIVE: set[FakeServer] = set()


async def close_all() -> None:
    """Kill every server started on this loop (no listener socket is left open)."""
    loop = asyncio.get_running_loop()
    for server in list(LIVE):
        if server._server is not None and server._server.get_loop() is loop:
            await server.kill()
            LIVE.discard(server)
    await asyncio.sleep(0.01)  # let the cut connections finish


def run(coro: Any, timeout: float = 15.0) -> Any:
    """Run a test coroutine on a fresh event loop, bounded in time; kill its servers after."""

    async def main() -> Any:
        try:
            return await asyncio.wait_for(coro, timeout)
        finally:
            await close_all()

    return asyncio.run(main())

"""A small in-process broker that speaks hello and the router's ``rtr_*`` ops (ROUTER spec).

Just enough for the client library's tests: facilities with int or str key ranges,
client and server registrations, routing by key, explicit/implicit prepare, votes,
outcomes, rtr_outcome, rtr_done, events (named with * and % wildcards, unnamed), and
replay to the next server of a partition when a server's connection is lost (MSG1
before a vote, UNCERTAIN after). The state lives in a :class:`FakeRouter` that
survives :meth:`FakeRouterServer.kill` / ``restart`` (a broker restarting on its store).
"""

from __future__ import annotations

import asyncio
import fnmatch
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from txbroker.errors import ErrorCode, ProtocolError
from txbroker.protocol.native import Err, NativeConnection, Ok, Push, Request, Role


class Refused(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Ctl:
    conn: FakeConn
    cid: int
    facility: str
    kind: str
    partition: str | None
    role: str
    explicit: bool
    recipient: str | None
    events: list[list[int]]
    busy: str | None = None


@dataclass
class Txn:
    tid: str
    client: Ctl | None
    facility: str
    state: str = "SENDING"  # SENDING, VREQ, ACCEPTED, REJECTED
    reason: str | None = None
    messages: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    servers: dict[str, Ctl | None] = field(default_factory=dict)
    votes: dict[str, bool | None] = field(default_factory=dict)
    presented: dict[str, int] = field(default_factory=dict)  # messages pushed per partition
    replays: dict[str, int] = field(default_factory=dict)


class FakeRouter:
    def __init__(self) -> None:
        self.facilities: dict[str, list[dict[str, Any]]] = {}
        self.ids = itertools.count(1)
        self.ctls: dict[int, Ctl] = {}
        self.txns: dict[str, Txn] = {}
        self.waiting: dict[tuple[str, str], deque[str]] = {}  # (facility, partition) -> tids
        self.log: list[tuple[str, dict[str, Any]]] = []
        self.pushes: list[tuple[int, dict[str, Any]]] = []

    def define(self, facility: str, partitions: list[tuple[str, Any, Any]]) -> None:
        self.facilities[facility] = [{"name": n, "low": lo, "high": hi} for n, lo, hi in partitions]

    def partition_of(self, facility: str, key: Any) -> str:
        parts = self.facilities[facility]
        if type(key) is not type(parts[0]["low"]):
            raise Refused(ErrorCode.BAD_REQUEST, f"key {key!r} is of the wrong type")
        for p in parts:
            if p["low"] <= key <= p["high"]:
                return str(p["name"])
        raise Refused(ErrorCode.BAD_REQUEST,
                      f"key {key} is outside every partition of facility {facility!r}")

    def push(self, ctl: Ctl, body: dict[str, Any]) -> None:
        data = {"controller": ctl.cid, **body}
        self.pushes.append((ctl.cid, data))
        ctl.conn.write(ctl.conn.codec.send(Push("rtr", data)))

    # ------------------------------------------------------------- routing

    def servers(self, facility: str, partition: str) -> list[Ctl]:
        return [c for c in self.ctls.values() if c.kind == "server" and c.facility == facility
                and c.partition == partition]

    def present_waiting(self, facility: str, partition: str) -> None:
        queue = self.waiting.get((facility, partition))
        while queue:
            free = [s for s in self.servers(facility, partition) if s.busy is None]
            if not free:
                return
            txn = self.txns[queue.popleft()]
            server = free[0]
            server.busy = txn.tid
            txn.servers[partition] = server
            txn.presented[partition] = 0
            self.feed(txn, partition)

    def feed(self, txn: Txn, partition: str) -> None:
        server = txn.servers.get(partition)
        if server is None:
            return
        msgs = txn.messages[partition]
        while txn.presented[partition] < len(msgs):
            index = txn.presented[partition]
            first = "MSG1"
            if index == 0 and txn.votes.get(partition) is not None:
                first = "UNCERTAIN"
            kind = first if index == 0 else "MSG"
            self.push(server, {"type": kind, "tid": txn.tid, "index": index,
                               "replay": txn.replays.get(partition, 0), **msgs[index]})
            txn.presented[partition] = index + 1
            if kind == "MSG" and txn.votes.get(partition) is True and txn.state == "SENDING":
                txn.votes[partition] = None  # a later message voids the vote
        if txn.state == "VREQ" and server.explicit and txn.votes.get(partition) is None:
            self.push(server, {"type": "PREPARE", "tid": txn.tid})
        if txn.state in ("ACCEPTED", "REJECTED"):
            self.push(server, {"type": txn.state, "tid": txn.tid, "reason": txn.reason})

    def route(self, txn: Txn, partition: str, message: dict[str, Any]) -> None:
        if partition not in txn.messages:
            txn.messages[partition] = []
            txn.votes[partition] = None
            txn.servers[partition] = None
            self.waiting.setdefault((txn.facility, partition), deque()).append(txn.tid)
        txn.messages[partition].append(message)
        if txn.servers[partition] is None:
            self.present_waiting(txn.facility, partition)
        else:
            self.feed(txn, partition)

    def check_decision(self, txn: Txn) -> None:
        if txn.state == "VREQ" and all(v is True for v in txn.votes.values()):
            self.decide(txn, "ACCEPTED", None)

    def decide(self, txn: Txn, state: str, reason: str | None) -> None:
        txn.state, txn.reason = state, reason
        for partition, server in txn.servers.items():
            if server is not None:
                self.push(server, {"type": state, "tid": txn.tid, "reason": reason})
            else:
                queue = self.waiting.get((txn.facility, partition))
                if queue and txn.tid in queue:
                    queue.remove(txn.tid)
        if txn.client is not None:
            self.push(txn.client, {"type": state, "tid": txn.tid, "reason": reason})

    def lost(self, ctl: Ctl) -> None:
        self.ctls.pop(ctl.cid, None)
        if ctl.kind == "client" or ctl.busy is None:
            if ctl.kind == "client":
                for txn in self.txns.values():
                    if txn.client is ctl:
                        txn.client = None
                        if txn.state == "SENDING":
                            self.decide(txn, "REJECTED", "CLIENT")
            return
        txn = self.txns[ctl.busy]
        partition = str(ctl.partition)
        txn.servers[partition] = None
        txn.replays[partition] = txn.replays.get(partition, 0) + 1
        if txn.state in ("ACCEPTED", "REJECTED") and txn.votes.get(partition) is None:
            return
        self.waiting.setdefault((txn.facility, partition), deque()).appendleft(txn.tid)
        self.present_waiting(txn.facility, partition)


def _matches(spec: str | None, name: str | None) -> bool:
    if spec is None:
        return True
    if name is None:
        return False
    return fnmatch.fnmatchcase(name, spec.replace("%", "?"))


class FakeConn:
    def __init__(self, server: FakeRouterServer, writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.router = server.router
        self.writer = writer
        self.codec = NativeConnection(Role.SERVER)
        self.ctls: list[Ctl] = []

    def write(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)

    def handle(self, request: Request) -> None:
        self.router.log.append((request.op, dict(request.args)))
        try:
            handler = getattr(self, "op_" + request.op, None)
            if handler is None:
                raise Refused(ErrorCode.UNKNOWN_OP, f"unknown op {request.op!r}")
            try:
                result = handler(request.args)
            except (KeyError, TypeError, ValueError) as exc:
                raise Refused(ErrorCode.BAD_REQUEST, f"bad arguments: {exc!r}") from exc
        except Refused as exc:
            if request.rid:
                self.write(self.codec.send(Err(request.rid, exc.code, str(exc))))
            else:
                self.write(self.codec.send(Push("error", {"code": int(exc.code),
                                                          "message": str(exc)})))
            return
        if request.rid and result is not _SENT and request.op not in self.server.hold_ops:
            self.write(self.codec.send(Ok(request.rid, result)))

    def ctl(self, args: dict[str, Any]) -> Ctl:
        ctl = self.router.ctls.get(args["controller"])
        if ctl is None or ctl.conn is not self:
            raise Refused(ErrorCode.NOT_FOUND, f"no controller {args['controller']}")
        return ctl

    def op_hello(self, args: dict[str, Any]) -> Any:
        return {"server": "txbroker", "version": 1, "session": 1,
                "max_frame_size": 1024 * 1024, "max_message_size": 512 * 1024}

    def op_ping(self, args: dict[str, Any]) -> Any:
        return {}

    def op_rtr_register(self, args: dict[str, Any]) -> Any:
        facility = args["facility"]
        parts = self.router.facilities.get(facility)
        if parts is None:
            raise Refused(ErrorCode.NOT_FOUND, f"no facility {facility!r}")
        partition = None
        if args["kind"] == "server":
            wanted = args["partition"]
            found = [p for p in parts if p["name"] == wanted
                     or (isinstance(wanted, list) and [p["low"], p["high"]] == wanted)]
            if not found:
                raise Refused(ErrorCode.NOT_FOUND, f"no partition {wanted!r}")
            partition = found[0]["name"]
        ctl = Ctl(self, next(self.router.ids), facility, args["kind"], partition,
                  args.get("role", "primary"), bool(args.get("explicit_prepare")),
                  args.get("recipient"), list(args.get("events") or []))
        self.router.ctls[ctl.cid] = ctl
        self.ctls.append(ctl)
        reply = {"controller": ctl.cid, "facility": facility,
                 "key_type": "int" if type(parts[0]["low"]) is int else "str",
                 "partitions": parts}
        if partition is not None:
            reply["partition"] = partition
            self.write(self.codec.send(Ok(self.server.current_rid, reply)))
            self.server.current_rid = 0
            self.router.present_waiting(facility, partition)
            return _SENT
        return reply

    def op_rtr_unregister(self, args: dict[str, Any]) -> Any:
        ctl = self.ctl(args)
        self.ctls.remove(ctl)
        self.router.lost(ctl)
        return {}

    def op_rtr_send(self, args: dict[str, Any]) -> Any:
        ctl = self.ctl(args)
        tid = args["tid"]
        partition = self.router.partition_of(ctl.facility, args["key"])
        txn = self.router.txns.get(tid)
        if txn is None:
            txn = self.router.txns[tid] = Txn(tid, ctl, ctl.facility)
        if txn.state != "SENDING":
            raise Refused(ErrorCode.ILLEGAL_STATE, f"transaction {tid} is already decided")
        self.router.route(txn, partition, {"key": args["key"], "body": args["body"],
                                           "headers": args.get("headers")})
        if args.get("accept"):
            self.accept(txn)
        return {"partition": partition}

    def accept(self, txn: Txn) -> None:
        txn.state = "VREQ"
        for partition, server in txn.servers.items():
            if server is not None and server.explicit and txn.votes[partition] is None:
                self.router.push(server, {"type": "PREPARE", "tid": txn.tid})
        self.router.check_decision(txn)

    def op_rtr_accept(self, args: dict[str, Any]) -> Any:
        self.ctl(args)
        txn = self.router.txns[args["tid"]]
        if txn.state != "SENDING":
            raise Refused(ErrorCode.ILLEGAL_STATE, f"transaction {txn.tid} is {txn.state}")
        self.accept(txn)
        return {}

    def op_rtr_reject(self, args: dict[str, Any]) -> Any:
        self.ctl(args)
        txn = self.router.txns.get(args["tid"])
        if txn is None:
            raise Refused(ErrorCode.NOT_FOUND, f"no transaction {args['tid']}")
        if txn.state != "SENDING":
            raise Refused(ErrorCode.ILLEGAL_STATE, f"transaction {txn.tid} is {txn.state}")
        self.router.decide(txn, "REJECTED", args.get("reason", "CLIENT"))
        return {}

    def op_rtr_vote(self, args: dict[str, Any]) -> Any:
        ctl = self.ctl(args)
        txn = self.router.txns.get(args["tid"])
        if txn is None or ctl.busy != txn.tid:
            raise Refused(ErrorCode.NOT_FOUND, f"transaction {args['tid']} is not presented "
                                               f"to controller {ctl.cid}")
        if txn.state in ("ACCEPTED", "REJECTED"):
            return {}
        partition = str(ctl.partition)
        if not args["accept"]:
            txn.votes[partition] = False
            self.router.decide(txn, "REJECTED", args.get("reason") or "SERVER")
            return {}
        if ctl.explicit and txn.state != "VREQ":
            raise Refused(ErrorCode.ILLEGAL_STATE, "explicit prepare: vote after PREPARE")
        txn.votes[partition] = True
        self.router.check_decision(txn)
        return {}

    def op_rtr_done(self, args: dict[str, Any]) -> Any:
        ctl = self.ctl(args)
        if ctl.busy == args["tid"]:
            ctl.busy = None
            self.router.present_waiting(ctl.facility, str(ctl.partition))
        return {}

    def op_rtr_ack(self, args: dict[str, Any]) -> Any:
        self.ctl(args)
        return {}

    def op_rtr_outcome(self, args: dict[str, Any]) -> Any:
        txn = self.router.txns.get(args["tid"])
        if txn is None:
            return {"tid": args["tid"], "state": "UNKNOWN", "reason": None}
        state = txn.state if txn.state in ("ACCEPTED", "REJECTED") else (
            "PENDING" if txn.state == "VREQ" else "UNKNOWN")
        return {"tid": txn.tid, "state": state, "reason": txn.reason}

    def op_rtr_event(self, args: dict[str, Any]) -> Any:
        ctl = self.ctl(args)
        number = args["number"]
        if not 0 <= number <= 255:
            raise Refused(ErrorCode.BAD_REQUEST, "user events are 0..255")
        target = "client" if ctl.kind == "server" else "server"
        count = 0
        for other in list(self.router.ctls.values()):
            if other.kind != target or other.facility != ctl.facility:
                continue
            if not any(lo <= number <= hi for lo, hi in other.events):
                continue
            if not _matches(args.get("recipient"), other.recipient):
                continue
            self.router.push(other, {"type": "USER_EVENT", "number": number,
                                     "body": args.get("body", b""),
                                     "recipient": args.get("recipient")})
            count += 1
        return {"delivered": count}

    def lost(self) -> None:
        for ctl in self.ctls:
            self.router.lost(ctl)
        self.ctls.clear()


_SENT: Any = object()


class FakeRouterServer:
    """A listener on 127.0.0.1 serving a FakeRouter; kill() and restart() keep the state."""

    def __init__(self, router: FakeRouter | None = None) -> None:
        self.router = router or FakeRouter()
        self.hold_ops: set[str] = set()
        self.conns: set[FakeConn] = set()
        self._server: asyncio.Server | None = None
        self.port = 0
        self.current_rid = 0

    @property
    def url(self) -> str:
        return f"txb://127.0.0.1:{self.port}"

    async def start(self) -> FakeRouterServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = FakeConn(self, writer)
        self.conns.add(conn)
        try:
            while data := await reader.read(65536):
                conn.codec.receive_data(data)
                try:
                    while events := conn.codec.drain():
                        for event in events:
                            assert isinstance(event, Request)
                            self.current_rid = event.rid
                            conn.handle(event)
                except ProtocolError:
                    break
        except (ConnectionError, OSError):
            pass
        finally:
            self.conns.discard(conn)
            conn.lost()
            writer.close()

    def drop_connections(self) -> None:
        for conn in list(self.conns):
            conn.writer.transport.abort()

    async def kill(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.close()
            self.drop_connections()
            await server.wait_closed()
        self.drop_connections()

    async def restart(self) -> None:
        await self.start()


def run(coro: Any, timeout: float = 15.0) -> Any:
    """Run a test coroutine on a fresh loop, bounded in time."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


class ThreadedFakeRouter:
    """A FakeRouterServer on its own event-loop thread (for the sync face's tests)."""

    def __init__(self, router: FakeRouter) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = FakeRouterServer(router)
        self.call(self.server.start())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def router(self) -> FakeRouter:
        return self.server.router

    def stop(self) -> None:
        self.call(self.server.kill())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

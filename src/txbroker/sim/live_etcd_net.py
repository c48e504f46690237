"""etcd on the deterministic event loop: the model (``sim/etcd_model.py``) as a cluster
that the production ``EtcdClient`` reaches through an httpx transport.

Theory of operation
-------------------
``EtcdClient`` takes an ``httpx.AsyncBaseTransport`` (``server/ha/etcd.py``;
production: httpx's own, over sockets). :class:`SimEtcdTransport` is one node's: it
hands each request's path and JSON body to :class:`SimEtcd`, which applies it to the
model after a network delay, in the cluster's own context (a stopped or killed node
does not stop etcd), and carries the answer back after another delay, in the node's
context (a stopped node reads it once continued; a killed one never). What httpx would
raise, the transport raises:

- a node **cut off** from etcd (:attr:`SimEtcd.cut`): ``"drop"`` (packets lost: a
  request sent meanwhile waits out its connect timeout, ``httpx.ConnectTimeout``; one
  already on its way is lost with its answer, ``httpx.ReadTimeout`` after the read
  timeout — the request may have been applied) or ``"reject"`` (a firewall's reset:
  ``httpx.ConnectError`` after one round trip);
- an answer that does not come within the request's read timeout:
  ``httpx.ReadTimeout`` (httpx's timeouts are the transport's job).

The cluster's lessor checks for expired leases every ``EXPIRY_CHECK_S`` on virtual
time, from a random phase. Nothing here reads a clock, global randomness, or starts a
thread: httpx's ``AsyncClient`` over a transport of its own opens no socket and starts
no thread (``tests/sim/test_etcd_live.py`` checks it); it stamps ``response.elapsed``
with ``time.perf_counter()``, which nothing reads.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import Callable
from typing import Any, Final

import httpx

from txbroker.sim.etcd_model import EXPIRY_CHECK_S, EtcdModel
from txbroker.sim.loop import SimLoop

__all__ = ["ETCD_DELAY_S", "SimEtcd", "SimEtcdTransport"]

#: One-way delay between a node and etcd, including etcd's raft commit (s, uniform).
ETCD_DELAY_S: Final = (0.0002, 0.004)
#: httpx's default timeout, for a request that names none (s).
HTTPX_DEFAULT_TIMEOUT_S: Final = 5.0

Reply = tuple[int, dict[str, Any]]
Answer = Callable[[Reply], None]


class SimEtcd:
    """The etcd cluster of one simulation: the model, the delays, the cuts, the lessor's
    periodic expiry check. ``log`` receives a trace line per key change."""

    def __init__(self, loop: SimLoop, log: Callable[[str], None]) -> None:
        self.loop = loop
        self.model = EtcdModel(first_lease=0x694D_0000_0000 + loop.random.randrange(1 << 16))
        #: host -> "drop" or "reject": the node is cut off from etcd
        self.cut: dict[str, str] = {}
        self.log = log
        self.requests = 0
        self._waiting: dict[int, list[Answer]] = {}
        self._logged = 0
        self.context = contextvars.Context()  # the cluster's own process (0)

    def start(self) -> None:
        """Start the lessor's expiry checks (at a random phase)."""
        self.loop.call_later(self.loop.random.uniform(0, EXPIRY_CHECK_S), self._check,
                             context=self.context)

    def delay(self) -> float:
        """One network delay to or from etcd."""
        return self.loop.random.uniform(*ETCD_DELAY_S)

    def send(self, host: str, path: str, body: dict[str, Any], answer: Answer) -> None:
        """A request from ``host`` on its way: applied after a delay unless ``host`` is
        cut off by then; ``answer`` gets the reply (it carries it back)."""
        self.loop.call_later(self.delay(), self._arrive, host, path, body, answer,
                             context=self.context)

    def _arrive(self, host: str, path: str, body: dict[str, Any], answer: Answer) -> None:
        if host in self.cut:
            return  # lost on the way
        self.requests += 1
        result = self.model.handle(path, body, self.loop.time())
        self._log_changes()
        if result is None:  # a keep-alive of an expired lease waits for its revocation
            self._waiting.setdefault(int(body.get("ID", 0)), []).append(answer)
        else:
            answer(result)

    def _check(self) -> None:
        for lease_id, reply in self.model.expire(self.loop.time()):
            for answer in self._waiting.pop(lease_id, []):
                answer(reply)
        self._log_changes()
        self.loop.call_later(EXPIRY_CHECK_S, self._check, context=self.context)

    def _log_changes(self) -> None:
        history = self.model.history
        for change in history[self._logged:]:
            what = "deleted" if change.value is None else f"= {change.value.decode()!r}"
            self.log(f"etcd: {change.key.decode()} {what} (lease {change.lease:x}, "
                     f"{change.why})")
        self._logged = len(history)


class SimEtcdTransport(httpx.AsyncBaseTransport):
    """One node's way to etcd (module docstring)."""

    def __init__(self, etcd: SimEtcd, host: str) -> None:
        self.etcd = etcd
        self.host = host

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` to the cluster; its answer, or what httpx would raise."""
        timeouts = request.extensions.get("timeout") or {}
        connect_s = timeouts.get("connect") or HTTPX_DEFAULT_TIMEOUT_S
        read_s = timeouts.get("read") or HTTPX_DEFAULT_TIMEOUT_S
        etcd, host = self.etcd, self.host
        cut = etcd.cut.get(host)
        if cut == "reject":
            await asyncio.sleep(2 * etcd.delay())
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if cut == "drop":
            await asyncio.sleep(connect_s)
            raise httpx.ConnectTimeout("timed out", request=request)
        raw = await request.aread()
        body = json.loads(raw) if raw else {}
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Reply] = loop.create_future()
        context = contextvars.copy_context()  # the node's: held while it is stopped

        def deliver(result: Reply) -> None:
            if not future.done():
                future.set_result(result)

        def answer(result: Reply) -> None:
            if host not in etcd.cut:  # else the answer is lost
                loop.call_later(etcd.delay(), deliver, result, context=context)

        etcd.send(host, request.url.path, body, answer)
        try:
            async with asyncio.timeout(read_s):
                status, reply = await future
        except TimeoutError:
            raise httpx.ReadTimeout("timed out", request=request) from None
        content = json.dumps(reply).encode()
        if request.url.path == "/v3/lease/keepalive":
            content += b"\n"  # a stream: one JSON object a line
        return httpx.Response(status, headers={"content-type": "application/json"},
                              content=content, request=request)

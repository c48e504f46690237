"""A small asyncio etcd v3 client over etcd's JSON gateway (``/v3/...``), with httpx.

What the replicated HA mode needs from etcd is little: leases (grant, keep-alive,
revoke), reads of one key or a prefix, a put, and two transactions — *create if
absent* and *delete if the value is still mine*. etcd 3.4 (Debian's
``etcd-server``) serves its v3 API as gRPC and, on the same client port, as JSON
through its gRPC gateway: every call is one ``POST`` with a JSON body, keys and
values base64-encoded, 64-bit integers as decimal strings. Why the gateway and
httpx rather than a gRPC client (``aetcd``) is written down in ``docs/etcd.md``:
no grpcio/protobuf native wheels, a client already in the tree, typed, and per
request timeouts that make fencing easy to reason about.

Errors are translated here, at the boundary: anything that means "etcd did not
answer" (connection refused, a timeout, a 5xx reply) raises
:class:`~txbroker.errors.EtcdUnavailable` naming the endpoint; a 4xx reply raises
:class:`~txbroker.errors.EtcdError` with etcd's message. With several endpoints a
call tries each in turn, starting with the one that answered last.

The lease and fencing logic built on this client is in ``server/ha/etcd_lease.py``.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

import httpx

from txbroker.errors import EtcdError, EtcdUnavailable

__all__ = ["EtcdClient", "EtcdTransport", "KeyValue", "prefix_end"]

#: What :class:`EtcdClient` may send its requests through instead of httpx's sockets.
EtcdTransport = httpx.AsyncBaseTransport

#: etcd's gRPC code for "requested lease not found" (NOT_FOUND).
_GRPC_NOT_FOUND = 5


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _key(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else key


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range request cover every key starting with
    ``prefix`` (etcd's rule: the prefix with its last byte below 0xff incremented)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd stores it.

    ``create_revision`` is the revision that created the key (it changes when the key
    is deleted and created again), ``mod_revision`` the one of its last change,
    ``lease`` the id of the lease it is attached to (0: none).
    """

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int

    @classmethod
    def from_json(cls, kv: dict[str, Any]) -> KeyValue:
        """Decode one ``kvs`` entry of a range reply."""
        return cls(key=_unb64(kv.get("key")), value=_unb64(kv.get("value")),
                   create_revision=int(kv.get("create_revision", 0)),
                   mod_revision=int(kv.get("mod_revision", 0)),
                   lease=int(kv.get("lease", 0)))


class EtcdClient:
    """An etcd v3 client for a list of endpoints (``http://host:port``).

    ``timeout`` bounds each HTTP exchange with one endpoint (connect, send, each
    read); a call that tries *n* endpoints may take up to *n* times as long.
    ``transport`` replaces httpx's own (sockets) with another ``httpx`` transport:
    the simulator's (``sim/live_etcd_net.py``) hands each request to its etcd model;
    None (production): httpx's default.
    """

    def __init__(self, endpoints: list[str], *, timeout: float = 2.0,
                 transport: EtcdTransport | None = None) -> None:
        if not endpoints:
            raise ValueError("EtcdClient needs at least one endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout = timeout
        self._current = 0
        self._http = httpx.AsyncClient(timeout=timeout, trust_env=False, transport=transport)

    async def close(self) -> None:
        """Close the HTTP connections."""
        await self._http.aclose()

    async def __aenter__(self) -> EtcdClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the transport ------------------------------------------------------------------

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``path`` on the first endpoint that answers; its JSON reply."""
        failures: list[str] = []
        n = len(self.endpoints)
        for i in range(n):
            index = (self._current + i) % n
            url = self.endpoints[index] + path
            try:
                response = await self._http.post(url, json=body)
            except httpx.TimeoutException as exc:
                failures.append(f"{url}: no answer within {self.timeout:g} s "
                                f"({type(exc).__name__})")
                continue
            except httpx.HTTPError as exc:  # refused, reset, DNS, ...
                failures.append(f"{url}: {type(exc).__name__}: {exc}")
                continue
            if response.status_code >= 500:
                failures.append(f"{url}: HTTP {response.status_code} {response.text[:200]}")
                continue
            self._current = index
            return self._decode(url, response)
        raise EtcdUnavailable("etcd is unavailable: " + "; ".join(failures))

    @staticmethod
    def _decode(url: str, response: httpx.Response) -> dict[str, Any]:
        try:
            # A streaming RPC (lease keep-alive) answers one JSON object per line.
            lines = response.content.strip().splitlines() or [b""]
            reply = json.loads(lines[0])
        except ValueError as exc:
            raise EtcdError(f"{url}: HTTP {response.status_code}, not JSON: "
                            f"{response.text[:200]!r}") from exc
        if not isinstance(reply, dict):
            raise EtcdError(f"{url}: unexpected reply {reply!r}")
        error = reply.get("error")
        if response.status_code >= 400 or error is not None:
            if isinstance(error, dict):  # a stream's error: {"error": {"grpc_code": ...}}
                code, message = error.get("grpc_code", 0), error.get("message", "")
            else:
                code, message = reply.get("code", 0), reply.get("message", error)
            raise EtcdError(f"{url}: etcd error {code}: {message}", int(code))
        return reply

    # -- leases -------------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> tuple[int, int]:
        """Grant a lease of ``ttl_s`` seconds: ``(lease_id, granted_ttl)``.

        etcd may grant more than asked: its minimum TTL is 1.5 election timeouts
        (2 s with the default 1 s election timeout). Fencing uses the granted TTL.
        """
        reply = await self._call("/v3/lease/grant", {"TTL": int(ttl_s)})
        return int(reply["ID"]), int(reply.get("TTL", 0))

    async def keepalive(self, lease_id: int) -> int:
        """Renew a lease once: its TTL from now in seconds, 0 when it has expired
        (or never existed)."""
        reply = await self._call("/v3/lease/keepalive", {"ID": str(lease_id)})
        result = reply.get("result", reply)
        return max(0, int(result.get("TTL", 0)))

    async def revoke(self, lease_id: int) -> None:
        """Revoke a lease, deleting every key attached to it (a lease already gone is
        not an error)."""
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease_id)})
        except EtcdUnavailable:
            raise
        except EtcdError as exc:
            if exc.grpc_code != _GRPC_NOT_FOUND:
                raise

    # -- keys ---------------------------------------------------------------------------

    async def get(self, key: str | bytes) -> KeyValue | None:
        """The key, or None when it does not exist."""
        reply = await self._call("/v3/kv/range", {"key": _b64(_key(key))})
        kvs = reply.get("kvs") or []
        return KeyValue.from_json(kvs[0]) if kvs else None

    async def get_prefix(self, prefix: str | bytes) -> list[KeyValue]:
        """Every key starting with ``prefix``, in key order."""
        raw = _key(prefix)
        reply = await self._call("/v3/kv/range",
                                 {"key": _b64(raw), "range_end": _b64(prefix_end(raw))})
        return [KeyValue.from_json(kv) for kv in reply.get("kvs") or []]

    async def put(self, key: str | bytes, value: str | bytes, *, lease: int | None = None
                  ) -> None:
        """Set the key (attached to ``lease`` when given; the lease must be alive)."""
        body: dict[str, Any] = {"key": _b64(_key(key)), "value": _b64(_key(value))}
        if lease:
            body["lease"] = str(lease)
        await self._call("/v3/kv/put", body)

    async def delete(self, key: str | bytes) -> bool:
        """Delete the key; whether it existed."""
        reply = await self._call("/v3/kv/deleterange", {"key": _b64(_key(key))})
        return int(reply.get("deleted", 0)) > 0

    async def create(self, key: str | bytes, value: str | bytes, *, lease: int,
                     unchanged: tuple[str | bytes, int] | None = None) -> bool:
        """Create the key attached to ``lease`` only if it does not exist (one
        transaction comparing its ``create_revision`` with 0) — and, with ``unchanged``
        ``(other key, mod_revision)``, only if that key's last change is still the one
        read (0: it still does not exist); whether it was created."""
        k = _b64(_key(key))
        put: dict[str, Any] = {"key": k, "value": _b64(_key(value))}
        if lease:
            put["lease"] = str(lease)
        compare = [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}]
        if unchanged is not None:
            compare.append({"key": _b64(_key(unchanged[0])), "target": "MOD",
                            "result": "EQUAL", "mod_revision": str(unchanged[1])})
        reply = await self._call("/v3/kv/txn", {
            "compare": compare, "success": [{"request_put": put}]})
        return bool(reply.get("succeeded", False))

    async def put_if_held(self, key: str | bytes, value: str | bytes, *,
                          holder_key: str | bytes, lease: int) -> bool:
        """Set ``key`` only while ``holder_key`` is attached to ``lease`` (one
        transaction comparing its ``lease``): a holder whose key was taken over writes
        nothing. Whether it wrote."""
        reply = await self._call("/v3/kv/txn", {
            "compare": [{"key": _b64(_key(holder_key)), "target": "LEASE", "result": "EQUAL",
                         "lease": str(lease)}],
            "success": [{"request_put": {"key": _b64(_key(key)), "value": _b64(_key(value))}}],
        })
        return bool(reply.get("succeeded", False))

    async def delete_if(self, key: str | bytes, value: str | bytes) -> bool:
        """Delete the key only if its value is ``value`` (one transaction): a holder
        stepping down removes its own key, never a successor's. Whether it deleted."""
        k = _b64(_key(key))
        reply = await self._call("/v3/kv/txn", {
            "compare": [{"key": k, "target": "VALUE", "result": "EQUAL",
                         "value": _b64(_key(value))}],
            "success": [{"request_delete_range": {"key": k}}],
        })
        return bool(reply.get("succeeded", False))

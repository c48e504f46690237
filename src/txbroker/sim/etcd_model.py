"""A model of etcd v3 on virtual time, answering the JSON gateway's requests as
``server/ha/etcd.py`` sends them (the ``replicated-etcd-live`` scenario).

Theory of operation
-------------------
One etcd cluster that never fails, seen through its gRPC gateway: each request is
``(path, JSON body)`` and the model answers ``(HTTP status, JSON reply)`` at the
virtual time ``now`` it is given (the model never reads a clock). What it keeps:

- **a revision**, raised by one for every request that changes a key (a put, a
  delete that deleted something, a transaction whose branch wrote, a lease revoke
  that deleted keys: one revision for all of them);
- **keys**: value, ``create_revision``, ``mod_revision``, ``version`` and the lease
  the key is attached to (a put without a lease detaches it);
- **leases**: granted TTL (at least :data:`MIN_TTL_S`, etcd's minimum with the
  default election timeout) and expiry. A grant or a keep-alive sets the expiry to
  ``now + TTL``. As etcd's lessor does, expired leases are revoked only by a check
  every :data:`EXPIRY_CHECK_S` (:meth:`EtcdModel.expire`, called by the simulation
  on that period): a lease lives from its expiry until the next check. A keep-alive
  of a lease that has expired but is not yet revoked waits for the revocation and
  then answers TTL 0 (etcd's ``Renew`` waits on ``revokec``): :meth:`handle` returns
  None and :meth:`expire` hands back the waiting answers.

Requests (the ones the client sends): ``/v3/lease/grant`` ``{"TTL"}``,
``/v3/lease/keepalive`` ``{"ID"}`` (a stream's first line: ``{"result": …}``),
``/v3/lease/revoke`` ``{"ID"}``, ``/v3/kv/range`` ``{"key", "range_end"?}``,
``/v3/kv/put`` ``{"key", "value", "lease"?}``, ``/v3/kv/deleterange`` ``{"key",
"range_end"?}`` and ``/v3/kv/txn`` with compares on ``CREATE``, ``MOD``, ``VERSION``,
``VALUE`` or ``LEASE`` (``EQUAL``, ``NOT_EQUAL``, ``GREATER``, ``LESS``) and
``request_put`` / ``request_delete_range`` / ``request_range`` operations. A value
compare on a key that does not exist fails (etcd's rule); the other targets compare
with zero. A put naming a lease that does not exist fails with gRPC code 5 (HTTP 404),
as does the revoke of an unknown lease. Keys and values are base64, 64-bit integers
decimal strings, and fields equal to zero are left out (the gateway's JSON).

Every change of a key is written to :attr:`EtcdModel.history` (time, key, value or
None for a delete, lease, why): the checkers read who held which key when.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["EXPIRY_CHECK_S", "MIN_TTL_S", "EtcdModel", "KeyChange", "Lease", "StoredKey"]

#: etcd's least lease TTL: 1.5 election timeouts (1 s by default), rounded up.
MIN_TTL_S: Final = 2
#: How often etcd's lessor looks for expired leases (``lessor.go``: every 500 ms).
EXPIRY_CHECK_S: Final = 0.5
#: gRPC's NOT_FOUND, and the HTTP status the gateway gives it.
NOT_FOUND: Final = 5
HTTP_NOT_FOUND: Final = 404

Reply = tuple[int, dict[str, Any]]


@dataclass
class StoredKey:
    """One key's state."""

    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass
class Lease:
    """One lease: its granted TTL (s) and when it expires (virtual s)."""

    ttl: int
    expiry: float


@dataclass(frozen=True)
class KeyChange:
    """A change of a key: at ``time``, ``value`` (None: deleted) under ``lease``."""

    time: float
    key: bytes
    value: bytes | None
    lease: int
    why: str


class EtcdFailure(Exception):
    """A request etcd refuses (its gRPC code)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _b(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _s(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class EtcdModel:
    """etcd's keys and leases (module docstring). ``first_lease`` is the first lease id
    handed out (the simulation draws it from its seed, as etcd's ids look random)."""

    def __init__(self, first_lease: int = 0x694D_0000_0000) -> None:
        self.revision = 1
        self.keys: dict[bytes, StoredKey] = {}
        self.leases: dict[int, Lease] = {}
        self.next_lease = first_lease
        self.history: list[KeyChange] = []
        #: lease id -> when it was revoked (expired or revoked on request)
        self.revoked: dict[int, float] = {}
        #: lease ids whose keep-alive waits for their revocation
        self.waiting: list[int] = []

    # -- requests -------------------------------------------------------------------

    def handle(self, path: str, body: dict[str, Any], now: float) -> Reply | None:
        """Answer one gateway request at ``now``; None: the answer waits for the next
        expiry check (a keep-alive of an expired lease)."""
        try:
            if path == "/v3/lease/grant":
                return 200, self._grant(body, now)
            if path == "/v3/lease/keepalive":
                lease_id = int(body.get("ID", 0))
                lease = self.leases.get(lease_id)
                if lease is not None and lease.expiry <= now:
                    self.waiting.append(lease_id)
                    return None
                return 200, {"result": self._keepalive(lease_id, lease, now)}
            if path == "/v3/lease/revoke":
                self._revoke(int(body.get("ID", 0)), now, "revoked", missing_fails=True)
                return 200, {"header": self._header()}
            if path == "/v3/kv/range":
                return 200, self._range(body)
            if path == "/v3/kv/put":
                self._check_put(body)
                self.revision += 1
                self._put(body, now, "put")
                return 200, {"header": self._header()}
            if path == "/v3/kv/deleterange":
                deleted = self._delete_range(body, now, "delete")
                if deleted:
                    self.revision += 1
                return 200, self._fields(header=self._header(), deleted=deleted)
            if path == "/v3/kv/txn":
                return 200, self._txn(body, now)
        except EtcdFailure as exc:
            return HTTP_NOT_FOUND, {"error": str(exc), "code": exc.code, "message": str(exc)}
        return 404, {"error": "Not Found", "code": NOT_FOUND, "message": f"no {path}"}

    def expire(self, now: float) -> list[tuple[int, Reply]]:
        """The lessor's periodic check: revoke every lease expired by ``now``. Returns
        the keep-alives that waited, with their answers (TTL 0: not found)."""
        for lease_id in sorted(i for i, lease in self.leases.items() if lease.expiry <= now):
            self._revoke(lease_id, now, "expired", missing_fails=False)
        waited = [i for i in self.waiting if i not in self.leases]
        self.waiting = [i for i in self.waiting if i in self.leases]
        return [(i, (200, {"result": self._fields(header=self._header(), ID=i)}))
                for i in waited]

    # -- leases ---------------------------------------------------------------------

    def _grant(self, body: dict[str, Any], now: float) -> dict[str, Any]:
        ttl = max(MIN_TTL_S, int(body.get("TTL", 0)))
        lease_id = self.next_lease
        self.next_lease += 1
        self.leases[lease_id] = Lease(ttl, now + ttl)
        return self._fields(header=self._header(), ID=lease_id, TTL=ttl)

    def _keepalive(self, lease_id: int, lease: Lease | None, now: float) -> dict[str, Any]:
        if lease is None:  # gone: the stream answers TTL 0 (not an error)
            return self._fields(header=self._header(), ID=lease_id)
        lease.expiry = now + lease.ttl
        return self._fields(header=self._header(), ID=lease_id, TTL=lease.ttl)

    def _revoke(self, lease_id: int, now: float, why: str, *, missing_fails: bool) -> None:
        if self.leases.pop(lease_id, None) is None:
            if missing_fails:
                raise EtcdFailure(NOT_FOUND, "etcdserver: requested lease not found")
            return
        self.revoked[lease_id] = now
        attached = sorted(k for k, kv in self.keys.items() if kv.lease == lease_id)
        if attached:
            self.revision += 1
            for key in attached:
                del self.keys[key]
                self.history.append(KeyChange(now, key, None, lease_id, f"lease {why}"))

    # -- keys -----------------------------------------------------------------------

    def _matching(self, body: dict[str, Any]) -> list[bytes]:
        key, end = _b(body.get("key")), _b(body.get("range_end"))
        if not end:
            return [key] if key in self.keys else []
        every = end == b"\0"
        return sorted(k for k in self.keys if k >= key and (every or k < end))

    def _range(self, body: dict[str, Any]) -> dict[str, Any]:
        found = self._matching(body)
        kvs = [self._fields(key=_s(k), value=_s(kv.value), create_revision=kv.create_revision,
                            mod_revision=kv.mod_revision, version=kv.version, lease=kv.lease)
               for k in found for kv in (self.keys[k],)]
        return self._fields(header=self._header(), kvs=kvs, count=len(kvs))

    def _check_put(self, body: dict[str, Any]) -> None:
        lease = int(body.get("lease", 0))
        if lease and lease not in self.leases:
            raise EtcdFailure(NOT_FOUND, "etcdserver: requested lease not found")

    def _put(self, body: dict[str, Any], now: float, why: str) -> None:
        """Write one key at revision :attr:`revision` (already raised)."""
        key, value, lease = _b(body.get("key")), _b(body.get("value")), int(body.get("lease", 0))
        old = self.keys.get(key)
        if old is None:
            self.keys[key] = StoredKey(value, self.revision, self.revision, 1, lease)
        else:
            old.value, old.mod_revision, old.version, old.lease = \
                value, self.revision, old.version + 1, lease
        self.history.append(KeyChange(now, key, value, lease, why))

    def _delete_range(self, body: dict[str, Any], now: float, why: str) -> int:
        found = self._matching(body)
        for key in found:
            kv = self.keys.pop(key)
            self.history.append(KeyChange(now, key, None, kv.lease, why))
        return len(found)

    def _compare(self, compare: dict[str, Any]) -> bool:
        kv = self.keys.get(_b(compare.get("key")))
        target, result = compare.get("target", "VERSION"), compare.get("result", "EQUAL")
        if target == "VALUE":
            if kv is None:
                return False  # etcd: a value compare on a missing key always fails
            ours, theirs = kv.value, _b(compare.get("value"))
            order = (ours > theirs) - (ours < theirs)
        else:
            field = {"CREATE": "create_revision", "MOD": "mod_revision",
                     "VERSION": "version", "LEASE": "lease"}[target]
            ours_n = 0 if kv is None else int(getattr(kv, field))
            theirs_n = int(compare.get(field, 0))
            order = (ours_n > theirs_n) - (ours_n < theirs_n)
        return {"EQUAL": order == 0, "NOT_EQUAL": order != 0, "GREATER": order > 0,
                "LESS": order < 0}[result]

    def _txn(self, body: dict[str, Any], now: float) -> dict[str, Any]:
        succeeded = all(self._compare(c) for c in body.get("compare") or [])
        ops = body.get("success" if succeeded else "failure") or []
        for op in ops:  # etcd checks the branch's leases before it applies any of it
            if "request_put" in op:
                self._check_put(op["request_put"])
        writes = any("request_put" in op or ("request_delete_range" in op
                                              and self._matching(op["request_delete_range"]))
                     for op in ops)
        if writes:
            self.revision += 1
        responses: list[dict[str, Any]] = []
        for op in ops:
            if "request_put" in op:
                self._put(op["request_put"], now, "txn put")
                responses.append({"response_put": {"header": self._header()}})
            elif "request_delete_range" in op:
                deleted = self._delete_range(op["request_delete_range"], now, "txn delete")
                responses.append({"response_delete_range": self._fields(
                    header=self._header(), deleted=deleted)})
            elif "request_range" in op:
                responses.append({"response_range": self._range(op["request_range"])})
        return self._fields(header=self._header(), succeeded=succeeded, responses=responses)

    # -- the gateway's JSON ---------------------------------------------------------

    def _header(self) -> dict[str, Any]:
        return {"cluster_id": "14841639068965178418", "member_id": "10276657743932975437",
                "revision": str(self.revision), "raft_term": "2"}

    @staticmethod
    def _fields(**fields: Any) -> dict[str, Any]:
        """A reply as the gateway writes it: 64-bit integers as strings, zero values
        (0, False, empty lists) left out."""
        out: dict[str, Any] = {}
        for name, value in fields.items():
            if value in (0, False, [], None, ""):
                continue
            out[name] = str(value) if isinstance(value, int) and \
                not isinstance(value, bool) else value
        return out

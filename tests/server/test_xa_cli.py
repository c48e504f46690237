"""``txbroker xa list|commit|rollback|forget`` against a real broker process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import txbroker
from tests.support import ROOT, STORES, BrokerProcess
from txbroker.errors import XA_HEURCOM, XA_HEURRB, XAError


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> str:
    """Every case runs on the journal and on the dir store (FDATASYNC,DSYNC; issue 17)."""
    return str(request.param)



def txb(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "250"}
    return subprocess.run([sys.executable, "-m", "txbroker.cli", *args], cwd=ROOT, env=env,
                          text=True, capture_output=True, check=check, timeout=120)


def test_operator_heuristics(broker: BrokerProcess) -> None:
    url = ["--url", broker.url]
    with txbroker.connect(broker.url) as conn:
        xa = conn.xa_resource()
        xids = [conn.xid(0, f"op-{i}", "b") for i in range(2)]
        for xid in xids:
            xa.start(xid)
            conn.send("out", xid.gtrid)
            xa.end(xid)
            xa.prepare(xid)
        open_one = conn.xid(0, "open", "b")
        xa.start(open_one)
        listed = json.loads(txb("xa", "list", "--json", *url).stdout)
        states = {b["xid"]: (b["state"], b["sent"]) for b in listed}
        assert states == {str(xids[0]): ("prepared", 1), str(xids[1]): ("prepared", 1),
                          str(open_one): ("active", 0)}
        table = txb("xa", "list", *url).stdout
        assert str(xids[0]) in table and "prepared" in table
        assert "heuristically committed" in txb("xa", "commit", str(xids[0]), *url).stdout
        assert "heuristically rolled back" in txb("xa", "rollback", str(xids[1]), *url).stdout
        assert sorted(xa.recover()) == sorted(xids)
        with pytest.raises(XAError) as info:
            xa.commit(xids[0])
        assert info.value.errcode == XA_HEURCOM
        with pytest.raises(XAError) as info:
            xa.rollback(xids[1])
        assert info.value.errcode == XA_HEURRB
        got = conn.receive("out", timeout=5)
        assert got is not None and got.body == b"op-0"
        got.ack(wait=True)
        assert conn.receive("out", timeout=0.2) is None
        failed = txb("xa", "forget", str(open_one), *url, check=False)
        assert failed.returncode == 1 and "XAER_PROTO" in failed.stderr
        for xid in xids:
            assert "forgotten" in txb("xa", "forget", str(xid), *url).stdout
        assert xa.recover() == []
        bad = txb("xa", "commit", "not-an-xid", *url, check=False)
        assert bad.returncode == 1 and "XAER_INVAL" in bad.stderr

"""Who may be promoted in a replicated group without etcd (``core/ha/promotion.py``):
each case written out by hand — a three-node group a, b, c unless said — with the
answer expected (None: promote; else a word the refusal must contain)."""

from __future__ import annotations

import pytest

from txbroker.core.ha.promotion import (
    Promise,
    ReadyRecord,
    Standing,
    majority,
    newest,
    next_term,
    promise_refusal,
    promotion_refusal,
    record_refusal,
)

R = ReadyRecord


def backup(node: str, record: ReadyRecord | None, following: str = "") -> Standing:
    return Standing(node, "backup", record, following)


T3_AB = R(3, 1, "a", ("b", "c"))  # term 3: a primary, b and c ready
T3_B = R(3, 2, "a", ("b",))  # then c left the ready set (recorded on a and b)
T3_NONE = R(3, 3, "a", ())  # then b left too (recorded on a and c, say)
T4_C = R(4, 0, "c", ())  # c promoted in term 4: its first record

CASES: list[tuple[str, Standing, str | None, list[Standing], str | None]] = [
    # a new group: nobody holds a record; any two of three may promote one
    ("new group", backup("a", None), None, [backup("b", None)], None),
    # rule 1: the node's own copy says no: that reason, whatever the peers say
    ("own copy incomplete", backup("a", None), "incomplete", [backup("b", None)],
     "incomplete"),
    # rule 2: a primary (or one promoting) answers: no second primary
    ("a primary answers", backup("b", T3_AB), None, [Standing("a", "primary", T3_AB)],
     "is the primary"),
    ("one is promoting", backup("b", T3_AB), None, [Standing("c", "promoting", T3_AB)],
     "is the promoting"),
    # rule 2 asks for a primary that answers: a peer still following one we cannot
    # reach (its link not yet known silent) does not stop the promotion
    ("a peer follows an unreachable primary", backup("b", T3_AB), None,
     [backup("c", T3_AB, following="a")], None),
    # rule 3: alone of three: a newer record may be out of sight
    ("alone of three", backup("c", T3_AB), None, [], "only 1 of the 3"),
    # rule 3: the same node answering twice counts once
    ("one peer twice of five", backup("a", None), None, [backup("b", None)] * 2,
     "only 2 of the 5"),
    # rule 4: c was dropped (the record on a and b says so): c may not, b may
    ("dropped c, heard b", backup("c", T3_AB), None, [backup("b", T3_B)], "ready set"),
    ("ready b, heard c", backup("b", T3_B), None, [backup("c", T3_AB)], None),
    # rule 4: the old primary itself, back as a backup, has every entry it answered
    ("old primary back", backup("a", T3_NONE), None, [backup("c", T3_NONE)], None),
    # rule 4: the primary answered alone (empty ready set on a majority): only a may
    ("answered alone", backup("b", T3_B), None, [backup("c", T3_NONE)], "ready set"),
    # rule 4: a newer term beats an older one, whatever its version
    ("newer term", backup("a", T3_AB), None, [backup("b", T4_C)], "term 4"),
    ("the newer term's primary", backup("c", T4_C), None, [backup("b", T3_B)], None),
    # five nodes: a majority is three
    ("two of five", backup("a", None), None, [backup("b", None)], "only 2 of the 5"),
    ("three of five", backup("a", None), None, [backup("b", None), backup("c", None)],
     None),
]


@pytest.mark.parametrize(("name", "own", "own_refusal", "peers", "expected"), CASES,
                         ids=[case[0] for case in CASES])
def test_promotion_rules(name: str, own: Standing, own_refusal: str | None,
                         peers: list[Standing], expected: str | None) -> None:
    group = 5 if "five" in name else 3
    refusal = promotion_refusal(own, own_refusal, group, peers)
    if expected is None:
        assert refusal is None, refusal
    else:
        assert refusal is not None and expected in refusal, refusal


def test_majorities() -> None:
    assert [majority(n) for n in (1, 2, 3, 4, 5, 6, 7)] == [1, 2, 2, 3, 3, 4, 4]


def test_newest_and_next_term() -> None:
    assert newest([None, T3_B, T3_AB, None]) == T3_B
    assert newest([T3_NONE, T4_C]) == T4_C
    assert newest([None]) is None
    assert next_term([backup("a", None), backup("b", None)]) == 1
    assert next_term([backup("a", T3_B), backup("b", T4_C)]) == 5


def test_records_and_standings_cross_the_wire_unchanged() -> None:
    standing = backup("c", T3_B, following="a")
    assert Standing.from_wire(standing.to_wire()) == standing
    assert Standing.from_wire(backup("c", None).to_wire()) == backup("c", None)
    assert R.from_wire(T4_C.to_wire()) == T4_C


@pytest.mark.parametrize("bad", [
    None, 3, [], {}, {"term": -1, "version": 0, "primary": "a", "ready": []},
    {"term": 1, "version": "0", "primary": "a", "ready": []},
    {"term": 1, "version": 0, "primary": 7, "ready": []},
    {"term": 1, "version": 0, "primary": "a", "ready": ["b", 3]},
    {"term": True, "version": 0, "primary": "a", "ready": "b"},
])
def test_a_malformed_record_is_none(bad: object) -> None:
    assert R.from_wire(bad) is None


def test_a_malformed_standing_is_none() -> None:
    assert Standing.from_wire({"node": "a"}) is None
    assert Standing.from_wire("a") is None
    # a malformed record inside a standing is no record
    assert Standing.from_wire({"node": "a", "role": "backup", "record": {"x": 1}}) == \
        backup("a", None)


def test_force_waives_the_majority_and_the_record_never_a_live_primary() -> None:
    alone = backup("c", T3_AB)
    assert promotion_refusal(alone, None, 3, [], force=True) is None
    assert promotion_refusal(alone, None, 3, [backup("b", T3_B)], force=True) is None
    assert promotion_refusal(alone, "incomplete", 3, [], force=True) == "incomplete"
    refusal = promotion_refusal(alone, None, 3, [Standing("a", "primary", T3_B)], force=True)
    assert refusal is not None and "is the primary" in refusal


# -- promises (Raft's vote): who may promise a term to whom ------------------------
P = Promise

PROMISE_CASES: list[tuple[str, Standing, Promise | None, int, str, str | None]] = [
    # a backup that promised nothing and holds term 3 promises term 4 to anybody
    ("fresh promise", backup("b", T3_AB), None, 4, "c", None),
    # the same promise asked again (a retry) is granted again
    ("same promise again", backup("b", T3_AB), P(4, "c"), 4, "c", None),
    # P1: a primary, or a node being promoted, promises nobody else a term
    ("primary", Standing("a", "primary", T3_AB), None, 4, "c", "is the primary"),
    ("promoting", Standing("b", "promoting", T3_AB), P(4, "b"), 4, "c", "is the promoting"),
    # ... but a node being promoted has promised its term to itself
    ("promoting, to itself", Standing("b", "promoting", T3_AB), P(4, "b"), 4, "b", None),
    # P2: it holds a record of the term asked or newer: that primary exists already
    ("holds that term", backup("b", T4_C), None, 4, "a", "holds term 4"),
    ("holds a newer term", backup("b", T4_C), None, 3, "a", "holds term 4"),
    ("holds that term of the asker", backup("b", T4_C), P(4, "c"), 4, "c", None),
    # P3: it still hears its primary (alive): no promise to depose it ...
    ("hears its primary", Standing("b", "backup", T3_AB, "a", hears="a"), None, 4, "c",
     "hears its primary a"),
    # ... but a follower whose primary fell silent (or whose link ended) promises
    ("primary silent", Standing("b", "backup", T3_AB, "a"), None, 4, "c", None),
    # P5: it promised a newer term, or this term to another node (P4: below)
    ("promised newer", backup("b", T3_AB), P(6, "a"), 5, "c", "promised term 6 to a"),
    ("promised to another", backup("b", T3_AB), P(4, "a"), 4, "c", "promised term 4 to a"),
    # an older promise does not bind a newer term
    ("older promise", backup("b", T3_AB), P(4, "a"), 5, "c", None),
    # a stopped node (a fenced old primary) may promise
    ("stopped", Standing("a", "stopped", T3_AB), None, 4, "c", None),
]


def test_a_promise_holds_other_candidates_off_for_a_while() -> None:
    # P4: a peer that promised term 4 to c just now refuses term 5 to a (c's promotion
    # is under way) but promises c again; once the hold passed, "recently" is "".
    refusal = promise_refusal(backup("b", T3_AB), P(4, "c"), 5, "a", recently="c")
    assert refusal is not None and "promised a term to c less than" in refusal
    assert promise_refusal(backup("b", T3_AB), P(4, "c"), 4, "c", recently="c") is None
    assert promise_refusal(backup("b", T3_AB), P(4, "c"), 5, "a", recently="") is None


@pytest.mark.parametrize(("name", "own", "promised", "term", "candidate", "expected"),
                         PROMISE_CASES, ids=[case[0] for case in PROMISE_CASES])
def test_promise_rules(name: str, own: Standing, promised: Promise | None, term: int,
                       candidate: str, expected: str | None) -> None:
    refusal = promise_refusal(own, promised, term, candidate)
    if expected is None:
        assert refusal is None, refusal
    else:
        assert refusal is not None and expected in refusal, refusal


RECORD_CASES: list[tuple[str, ReadyRecord | None, Promise | None, ReadyRecord,
                         str | None]] = [
    # nothing held, nothing promised: any record
    ("first record", None, None, T3_AB, None),
    # a newer version of the same term, a newer term
    ("newer version", T3_AB, None, T3_B, None),
    ("newer term", T3_B, None, T4_C, None),
    # R1: an older term
    ("older term", T4_C, None, T3_NONE, "not newer than term 4"),
    # R2: a second primary of the same term
    ("same term, other primary", T3_AB, None, R(3, 4, "b", ()), "not newer than term 3"),
    # R3: older than the term promised (the old primary, alive behind a partition)
    ("older than promised", T3_AB, P(4, "c"), T3_B, "older than term 4, promised to c"),
    # the promised term from another primary: it won the term (each node promises a
    # term once, so only one node gets a majority of promises): it is followed
    ("promised term, other", T3_AB, P(4, "c"), R(4, 0, "b", ()), None),
    # the candidate's own first record is taken, and a newer term's too
    ("promised term, candidate", T3_AB, P(4, "c"), T4_C, None),
    ("newer than promised", T3_AB, P(4, "c"), R(5, 0, "a", ()), None),
]


@pytest.mark.parametrize(("name", "mine", "promised", "record", "expected"), RECORD_CASES,
                         ids=[case[0] for case in RECORD_CASES])
def test_record_rules(name: str, mine: ReadyRecord | None, promised: Promise | None,
                      record: ReadyRecord, expected: str | None) -> None:
    refusal = record_refusal(mine, promised, record)
    if expected is None:
        assert refusal is None, refusal
    else:
        assert refusal is not None and expected in refusal, refusal


def test_next_term_is_newer_than_every_promise() -> None:
    assert next_term([backup("a", T3_AB), Standing("b", "backup", T3_B, promised=7)]) == 8
    assert next_term([Standing("a", "backup", None, promised=2)]) == 3


def test_promises_and_granted_standings_cross_the_wire_unchanged() -> None:
    assert P.from_wire(P(4, "c").to_wire()) == P(4, "c")
    granted = Standing("b", "backup", T3_AB, "", promised=4, granted=True, hears="a")
    assert Standing.from_wire(granted.to_wire()) == granted


@pytest.mark.parametrize("bad", [None, 3, {}, {"term": 0, "candidate": "a"},
                                 {"term": 1, "candidate": ""}, {"term": "1", "candidate": "a"},
                                 {"term": True, "candidate": "a"}, {"term": 1}])
def test_a_malformed_promise_is_none(bad: object) -> None:
    assert P.from_wire(bad) is None

"""Who may be promoted in a replicated group without etcd (``core/ha/promotion.py``):
each case written out by hand — a three-node group a, b, c unless said — with the
answer expected (None: promote; else a word the refusal must contain)."""

from __future__ import annotations

import pytest

from txbroker.core.ha.promotion import (
    ReadyRecord,
    Standing,
    majority,
    newest,
    next_term,
    promotion_refusal,
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

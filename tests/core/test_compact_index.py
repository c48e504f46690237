"""The compact index (core/messages.py Chunk, MessageIndex; core/queues.py levels):
exact contents after operations, and a property test against a plain model."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from txbroker.core.messages import CHUNK_SIZE, Message, MessageIndex, State, compactable
from txbroker.core.queues import PRIORITIES, Queue

REF_BASE = 7 << 72  # a journal-like ref: segment 7, offset and length below


def ref_of(message_id: int) -> int:
    return REF_BASE | message_id << 32 | 1000 + message_id


def put(queue: Queue, home: MessageIndex, message_id: int, priority: int = 4) -> None:
    queue.put_compact(home, message_id, priority, message_id * 10, ref_of(message_id),
                      1000 + message_id, 5000 + message_id, message_id % 3)


def check_fields(message: Message, message_id: int, priority: int = 4) -> None:
    assert (message.id, message.queue, message.priority, message.seq, message.ref,
            message.size, message.timestamp_ms, message.delivery_count, message.state,
            message.message_id, message.headers, message.persistent) == (
        message_id, "q", priority, message_id * 10, ref_of(message_id), 1000 + message_id,
        5000 + message_id, message_id % 3, State.READY, None, None, True)


def test_slots_come_back_as_messages_in_order() -> None:
    home, queue = MessageIndex(), Queue("q")
    for message_id in range(1, 11):
        put(queue, home, message_id)
    assert len(home) == 10 and home.compact == 10 and not home.objects
    assert queue.ready_count == 10
    first = queue.pop_ready()
    assert first is not None
    check_fields(first, 1)
    assert home.objects == {1: first} and home.compact == 9 and len(home) == 10
    assert [m.id for m in iter(queue.pop_ready, None)] == list(range(2, 11))
    assert queue.ready_count == 0 and home.compact == 0 and not home.blocks


def test_lookup_promotes_once_and_keeps_the_place() -> None:
    home, queue = MessageIndex(), Queue("q")
    for message_id in (3, 5, 9):
        put(queue, home, message_id)
    found = home.get(5)
    assert found is not None and home.get(5) is found and home[5] is found
    check_fields(found, 5)
    assert home.compact == 2 and 5 in home and 4 not in home and home.get(4) is None
    assert sorted(home) == [3, 5, 9]
    popped = [queue.pop_ready() for _ in range(3)]
    assert [m.id for m in popped if m] == [3, 5, 9] and popped[1] is found


def test_discarded_and_moved_slots_are_skipped() -> None:
    home, queue = MessageIndex(), Queue("q")
    for message_id in range(1, 6):
        put(queue, home, message_id)
    gone = home[2]
    queue.discard(gone)
    home.pop(2)
    moved = home[4]
    moved.queue = "elsewhere"
    queue.ready_count -= 1
    assert [m.id for m in iter(queue.pop_ready, None)] == [1, 3, 5]
    assert queue.ready_count == 0


def test_chunks_split_when_full_or_ids_descend() -> None:
    home, queue = MessageIndex(), Queue("q")
    ids = [*range(1, CHUNK_SIZE + 3), 1_000_000, 500_000]
    for message_id in ids:
        put(queue, home, message_id)
    level = queue._ready[4]
    assert [len(chunk.ids) for chunk in level] == [CHUNK_SIZE, 3, 1]  # type: ignore[union-attr]
    assert home.get(500_000) is not None and home.get(CHUNK_SIZE + 1) is not None
    assert [m.id for m in iter(queue.pop_ready, None)] == ids


def test_extend_compact_matches_one_at_a_time() -> None:
    home, queue = MessageIndex(), Queue("q")
    ids = [5, 6, 7, 100_000, 100_001]
    columns = [ids, [i * 10 for i in ids], [ref_of(i) for i in ids], [1000 + i for i in ids],
               [5000 + i for i in ids], [i % 3 for i in ids], list(range(1, 6))]
    queue.extend_compact(home, 4, columns)
    queue.extend_compact(home, 4, [[3, 2], [30, 20], [ref_of(3), ref_of(2)], [1003, 1002],
                                   [5003, 5002], [0, 2], [6, 7]])  # (descending: slow path)
    assert queue.ready_count == 7 and len(home) == 7
    check_fields(home[100_000], 100_000)
    assert [m.id for m in home.values()] == [5, 6, 7, 100_000, 100_001, 3, 2]  # log order
    popped = list(iter(queue.pop_ready, None))
    assert [m.id for m in popped] == [5, 6, 7, 100_000, 100_001, 3, 2]
    for message in popped:
        check_fields(message, message.id)


def test_detach_and_browse_see_compact_slots() -> None:
    home, queue = MessageIndex(), Queue("q")
    for message_id in range(1, 5):
        put(queue, home, message_id, priority=message_id % 2 * 5)
    assert [m.id for m in queue.browse(3)] == [1, 3, 2]
    assert [m.id for m in queue.ready_messages()] == [2, 4, 1, 3]
    assert sorted(m.id for m in queue.detach_visible()) == [1, 2, 3, 4]
    assert home.compact == 0 and not home.blocks and queue.ready_count == 0


def test_compactable() -> None:
    plain = Message(1, "q", 10, ref=5)
    assert compactable(plain)
    assert not compactable(Message(1, "q", 10, ref=None))
    assert not compactable(Message(1, "q", 10, message_id="x", ref=5))
    assert not compactable(Message(1, "q", 10, headers={"a": "b"}, ref=5))
    assert not compactable(Message(1, "q", 10, expires_ms=9, ref=5))
    assert not compactable(Message(1, "q", 10, persistent=False, ref=5))


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, PRIORITIES - 1), st.booleans()),
    st.tuples(st.just("pop"), st.just(0), st.just(False)),
    st.tuples(st.just("requeue"), st.just(0), st.just(False)),
    st.tuples(st.just("lookup"), st.integers(0, 400), st.just(False)),
    st.tuples(st.just("drop"), st.integers(0, 400), st.just(False)),
), max_size=120)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_property_against_a_model(ops: list[tuple[str, int, bool]]) -> None:
    """Compact slots, objects, promotions, drops and requeues keep the order a plain
    model (a deque per priority) has; the index finds exactly what is present."""
    home, queue = MessageIndex(), Queue("q")
    model: list[deque[int]] = [deque() for _ in range(PRIORITIES)]
    priority_of: dict[int, int] = {}
    delivered: list[Message] = []
    next_id = 1
    for op, arg, flag in ops:
        if op == "add":
            next_id += 1 + next_id % 3  # ids ascend with gaps
            priority_of[next_id] = arg
            if flag:
                put(queue, home, next_id, arg)
            else:
                message = Message(next_id, "q", 1, priority=arg, ref=ref_of(next_id))
                home[next_id] = message
                queue.put(message, 0)
            model[arg].append(next_id)
        elif op == "pop":
            got = queue.pop_ready()
            want = next((level.popleft() for level in reversed(model) if level), None)
            assert (got.id if got else None) == want
            if got is not None:
                got.state = State.DELIVERED
                delivered.append(got)
        elif op == "requeue" and delivered:
            message = delivered.pop()
            queue.put(message, 0, front=True)
            model[message.priority].appendleft(message.id)
        elif op == "lookup":
            message_id = sorted(priority_of)[arg % len(priority_of)] if priority_of else 0
            present = any(message_id in level for level in model) or any(
                m.id == message_id for m in delivered)
            found = home.get(message_id)
            assert (found is not None) == present
            if found is not None:
                assert found.id == message_id and home.get(message_id) is found
        elif op == "drop":
            ready = [i for level in model for i in level]
            if ready:
                message_id = ready[arg % len(ready)]
                message = home[message_id]
                queue.discard(message)
                home.pop(message_id)
                model[priority_of[message_id]].remove(message_id)
        assert queue.ready_count == sum(len(level) for level in model)
        assert len(home) == queue.ready_count + len(delivered)
    assert [m.id for m in iter(queue.pop_ready, None)] == [
        i for level in reversed(model) for i in level]

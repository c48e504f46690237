"""The journal's checkpoint file (``storage/journal_checkpoint.py``, issue 29): a clean
close writes it, the next recovery hands back its one entry instead of the log — only
while the log is exactly as the checkpoint says — and deletes it whatever it reads."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from txbroker.server.config import ServerConfig
from txbroker.server.stores import open_store
from txbroker.storage.journal import JournalStore
from txbroker.storage.journal_checkpoint import CHECKPOINT_FILE

from .contract import append_all, contents, recover
from .support import Loop

KIND = 19
ENTRIES = [(4, b"meta%d" % number, [b"body%d" % number * 20]) for number in range(30)]


def _store(directory: Path, loop: Loop, *, checkpoints: bool = True,
           segment_size: int = 1024 * 1024) -> JournalStore:
    return JournalStore(directory, dispatch=loop.dispatch, checkpoints=checkpoints,
                        segment_size=segment_size)


def _written(directory: Path, segment_size: int = 1024 * 1024) -> tuple[Loop, list[list[int]]]:
    """A journal of ENTRIES, two bodies released, closed with a checkpoint."""
    loop = Loop()
    store = _store(directory, loop, segment_size=segment_size)
    recover(store)
    refs = append_all(store, loop, ENTRIES)
    store.release(refs[0][0])
    store.release(refs[1][0])
    store.close(checkpoint=(KIND, b"the state", store.appends))
    return loop, refs


def _checkpoint(directory: Path) -> Path:
    return directory / "journal" / CHECKPOINT_FILE


def test_a_clean_close_leaves_a_checkpoint_the_next_recovery_reads(tmp_path: Path) -> None:
    loop, refs = _written(tmp_path)
    assert _checkpoint(tmp_path).exists()
    store = _store(tmp_path, loop)
    entries = recover(store)
    assert [(e.kind, e.meta, e.refs) for e in entries] == [(KIND, b"the state", ())]
    assert store.recovered_from_checkpoint
    assert not _checkpoint(tmp_path).exists()  # deleted before any append
    stats = store.stats()
    assert (stats.recovered_entries, stats.recovered_segments) == (1, 0)
    assert stats.live_bodies == len(ENTRIES) - 2  # the releases of the last run
    assert store.read_body(refs[5][0]) == ENTRIES[5][2][0]
    append_all(store, loop, [(4, b"after", [b"x"])])
    store.close()  # no checkpoint: the next start replays the whole log
    again = _store(tmp_path, loop)
    assert [e.meta for e in recover(again)] == [m for _, m, _ in ENTRIES] + [b"after"]
    assert not again.recovered_from_checkpoint
    again.close()


def test_a_store_not_asked_to_use_it_deletes_it_and_replays(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    loop, _ = _written(tmp_path)
    store = _store(tmp_path, loop, checkpoints=False)
    with caplog.at_level(logging.INFO, logger="txbroker.journal"):
        assert contents(store, recover(store)) == ENTRIES
    assert "not used (not asked to)" in caplog.text
    assert not _checkpoint(tmp_path).exists()
    store.close()


def test_a_checkpoint_whose_log_moved_on_is_not_used(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """An older version that ignored the file appended to the log: the entry after the
    end the checkpoint records shows it."""
    loop, _ = _written(tmp_path)
    kept = tmp_path / "kept"
    shutil.copy(_checkpoint(tmp_path), kept)
    older = _store(tmp_path, loop, checkpoints=False)
    recover(older)
    append_all(older, loop, [(4, b"after", [b"x"])])
    older.close()
    shutil.copy(kept, _checkpoint(tmp_path))
    store = _store(tmp_path, loop)
    with caplog.at_level(logging.WARNING, logger="txbroker.journal"):
        assert [e.meta for e in recover(store)] == [m for _, m, _ in ENTRIES] + [b"after"]
    assert "an entry follows the end it records" in caplog.text
    store.close()


def test_a_checkpoint_of_other_segments_is_not_used(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    loop, _ = _written(tmp_path, segment_size=1024)  # many segments
    kept = tmp_path / "kept"
    shutil.copy(_checkpoint(tmp_path), kept)
    older = _store(tmp_path, loop, checkpoints=False, segment_size=1024)
    recover(older)
    append_all(older, loop, [(4, b"m", [b"y" * 900]) for _ in range(3)])  # new segments
    older.close()
    shutil.copy(kept, _checkpoint(tmp_path))
    store = _store(tmp_path, loop, segment_size=1024)
    with caplog.at_level(logging.WARNING, logger="txbroker.journal"):
        assert len(recover(store)) == len(ENTRIES) + 3
    assert "it lists segments" in caplog.text
    store.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty"])
def test_a_damaged_checkpoint_is_not_used(tmp_path: Path, damage: str,
                                          caplog: pytest.LogCaptureFixture) -> None:
    loop, _ = _written(tmp_path)
    path = _checkpoint(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
    elif damage == "truncate":
        del data[len(data) - 5:]
    elif damage == "garbage":
        data[:] = b"not a checkpoint at all"
    else:
        data.clear()
    path.write_bytes(bytes(data))
    store = _store(tmp_path, loop)
    with caplog.at_level(logging.WARNING, logger="txbroker.journal"):
        assert contents(store, recover(store)) == ENTRIES
    assert "is not used" in caplog.text
    assert not path.exists()
    store.close()


def test_no_checkpoint_is_written_when_the_log_moved_on_since_it_was_taken(tmp_path: Path
                                                                         ) -> None:
    loop = Loop()
    store = _store(tmp_path, loop)
    recover(store)
    append_all(store, loop, ENTRIES[:3])
    mark = store.appends
    append_all(store, loop, ENTRIES[3:4])
    store.close(checkpoint=(KIND, b"stale", mark))
    assert not _checkpoint(tmp_path).exists()


def test_a_store_that_keeps_none_writes_none(tmp_path: Path) -> None:
    loop = Loop()
    store = _store(tmp_path, loop, checkpoints=False)
    recover(store)
    append_all(store, loop, ENTRIES[:3])
    store.close(checkpoint=(KIND, b"state", store.appends))
    assert not _checkpoint(tmp_path).exists()


def test_a_torn_checkpoint_write_leaves_no_trace(tmp_path: Path) -> None:
    loop, _ = _written(tmp_path)
    torn = tmp_path / "journal" / (CHECKPOINT_FILE + ".tmp")
    torn.write_bytes(b"half")
    _checkpoint(tmp_path).unlink()
    store = _store(tmp_path, loop)
    assert contents(store, recover(store)) == ENTRIES
    assert not torn.exists()
    store.close()


@pytest.mark.parametrize(("ha", "asked", "keeps"), [("", True, True), ("", False, False),
                                                    ("shared-store", True, False),
                                                    ("replicated", True, False)])
def test_a_server_keeps_checkpoints_only_without_ha(tmp_path: Path, ha: str, asked: bool,
                                                    keeps: bool) -> None:
    """``recovery_checkpoint`` reaches the journal of a broker without HA only: a
    shared-store standby resumes what it followed, a replicated node's log counts its
    primary's LSNs (both would be wrong to start from a checkpoint)."""
    config = ServerConfig(data=tmp_path, recovery_checkpoint=asked, ha=ha)
    store = open_store(config, lambda completions: None, lambda: (1, b""))
    assert isinstance(store, JournalStore) and store.checkpoints is keeps

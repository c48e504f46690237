"""Message stores: the ``Store`` protocol and its implementations.

* :mod:`~txbroker.storage.interface` — the protocol every store implements;
* :mod:`~txbroker.storage.journal` (``JournalStore``) — the default store: a
  segmented append-only log with CRCs and group commit (``docs/storage.md``);
* :mod:`~txbroker.storage.dirstore` (``DirStore``) — the Enduro/X-style
  file-per-command store (``docs/dirstore.md``);
* :mod:`~txbroker.storage.memory` (``MemoryStore``) — in memory, for unit tests;
* :mod:`~txbroker.core.records` — what the broker writes into entries.

Importing this package loads no store (no files, threads or ``os`` calls):
import the store's own module (``txbroker.storage.journal`` …) to use it.
"""

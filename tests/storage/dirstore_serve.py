"""``txbroker serve`` on the dir store, for process tests until the CLI has ``--store dir``.

Usage: ``python -m tests.storage.dirstore_serve serve --data DIR ...`` (the
``txbroker`` CLI's arguments); ``TXBROKER_DIR_FLAGS`` sets the sync flags.
It replaces ``txbroker.server.app.open_store`` with one that opens a
:class:`~txbroker.storage.dirstore.DirStore`, then runs the CLI.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from txbroker.server import app
from txbroker.server.config import ServerConfig
from txbroker.storage.dirstore import DirStore
from txbroker.storage.interface import Store

#: Environment variable with the dir store's sync flags (default: none).
FLAGS_VARIABLE = "TXBROKER_DIR_FLAGS"


def open_dir_store(
    config: ServerConfig,
    dispatch: Callable[[Callable[[], None]], None],
    snapshot: Callable[[], tuple[int, bytes]],
) -> Store:
    """What ``open_store`` does for ``--store dir``."""
    return DirStore(
        config.data,
        flags=os.environ.get(FLAGS_VARIABLE, ""),
        dispatch=dispatch,
        snapshot_provider=snapshot,
    )


if __name__ == "__main__":
    app.open_store = open_dir_store
    from txbroker.cli import main

    main()

"""Which build of the hot path runs: mypyc-compiled or pure Python (docs/performance.md).

``pip install`` compiles ``txbroker.core``, ``txbroker.protocol`` and the storage
encoders with mypyc when a C compiler and the Python headers are present (setup.py);
the ``.py`` sources stay next to the extension modules. Importing :mod:`txbroker`
calls :func:`choose` before anything else, which picks the pure-Python sources
instead of the compiled modules when

- the environment sets ``TXBROKER_PURE=1``, or
- the compiled modules are *stale*: the digest of the sources they were built from
  (written by setup.py to ``_compiled_from.txt``) differs from the sources now on
  disk, as after editing a module in an editable install. Running stale compiled
  code would run something else than the source says; the pure sources are always
  right.

The choice is all or nothing: compiled modules call each other natively through
their one shared library, so mixing compiled and pure modules of that set would
let two versions of one module run side by side.

This module must not import anything from the compiled set.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Final

#: The sources mypyc compiles, relative to the package directory (setup.py reads this):
#: the pure core (with its records, router and HA packages) and codecs (AMQP's too),
#: the storage encoders, and the request path every protocol edge shares (the
#: operations layer) with the STOMP edge's frame handler.
COMPILED: Final = ("core", "core/records", "core/router", "core/ha", "protocol",
                   "protocol/amqp", "storage/journal_format.py", "storage/journal_scan.py",
                   "storage/dirstore_format.py", "server/ops", "server/edges/stomp/frames.py")
#: The tests of the compiled set that ``make test`` runs a second time on the pure-Python
#: sources (``TXBROKER_PURE=1``), relative to the repository; the Makefile reads them with
#: ``python src/txbroker/_build.py pure-tests`` (and its sources with ``... sources``).
PURE_TESTS: Final = ("tests/core", "tests/protocol", "tests/storage",
                     "tests/amqp/test_codec.py", "tests/amqp/test_codec_hot.py",
                     "tests/server/test_ops.py", "tests/stomp/test_listener.py",
                     "tests/stomp/test_stomppy.py", "tests/test_build.py")
#: The file setup.py writes next to this one: the digest of the sources compiled.
DIGEST_FILE: Final = "_compiled_from.txt"
#: The environment variable that asks for the pure-Python build.
PURE_ENV: Final = "TXBROKER_PURE"

_PACKAGE_DIR: Final = Path(__file__).resolve().parent

#: What :func:`choose` decided: ``"compiled"``, ``"pure"``, ``"pure (TXBROKER_PURE=1)"``
#: or ``"pure (stale build: …)"``.
MODE = "pure"


def compiled_sources(package_dir: Path = _PACKAGE_DIR) -> list[Path]:
    """The ``.py`` files of the compiled set, sorted."""
    paths: list[Path] = []
    for entry in COMPILED:
        path = package_dir / entry
        paths.extend(sorted(path.glob("*.py")) if path.is_dir() else [path])
    return paths


def sources_digest(package_dir: Path = _PACKAGE_DIR) -> str:
    """SHA-256 over the compiled set's relative names and contents."""
    digest = hashlib.sha256()
    for path in compiled_sources(package_dir):
        digest.update(path.relative_to(package_dir).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def _has_extensions(package_dir: Path) -> bool:
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return any(p.name.endswith(suffixes) for p in (package_dir / "core").iterdir())


class _PureFinder:
    """A meta-path finder that loads ``txbroker.*`` modules from ``.py`` sources only."""

    @staticmethod
    def find_spec(fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("txbroker.") or path is None:
            return None
        loaders = (importlib.machinery.SourceFileLoader,
                   importlib.machinery.SOURCE_SUFFIXES)
        for entry in path:
            spec = importlib.machinery.FileFinder(entry, loaders).find_spec(fullname)
            if spec is not None:
                return spec
        return None


def choose(package_dir: Path = _PACKAGE_DIR) -> str:
    """Pick the build for this process (once, before the compiled set is imported)."""
    global MODE
    if any(isinstance(f, _PureFinder) for f in sys.meta_path):
        return MODE
    if not _has_extensions(package_dir):
        MODE = "pure"
        return MODE
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        MODE = f"pure ({PURE_ENV}=1)"
    else:
        try:
            built_from = (package_dir / DIGEST_FILE).read_text().strip()
        except OSError:
            built_from = ""
        if built_from == sources_digest(package_dir):
            MODE = "compiled"
            return MODE
        MODE = "pure (stale build: the sources changed since it was compiled; rebuild " \
               "with `make venv` or pip install)"
    sys.meta_path.insert(0, _PureFinder())
    return MODE


if __name__ == "__main__":  # the Makefile's one source of the compiled set
    _what = sys.argv[1] if len(sys.argv) > 1 else ""
    if _what == "sources":
        _root = _PACKAGE_DIR.parent.parent
        print(" ".join(p.relative_to(_root).as_posix() for p in compiled_sources()))
    elif _what == "pure-tests":
        print(" ".join(PURE_TESTS))
    else:
        sys.exit("usage: python src/txbroker/_build.py sources|pure-tests")

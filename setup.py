"""Build: compile the hot path with mypyc when this machine can (docs/performance.md).

``txbroker.core``, ``txbroker.protocol`` and the storage encoders are compiled into C
extensions next to their unchanged ``.py`` sources. Without a C compiler or the
Python headers, or with ``TXBROKER_PURE=1`` in the environment, nothing is compiled
and the package is pure Python (``txbroker._build`` also falls back at import time).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
PACKAGE = ROOT / "src" / "txbroker"
sys.path.insert(0, str(PACKAGE))
from _build import COMPILED, DIGEST_FILE, PURE_ENV, compiled_sources, sources_digest  # noqa: E402

sys.path.pop(0)


def can_compile() -> str:
    """Why not (an empty string when this machine can build C extensions)."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return f"{PURE_ENV} is set"
    # setuptools compiles with $CC when it is set, else with the compiler Python was
    # built with: check the one it will use.
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")[:1]
    if not compiler or shutil.which(compiler[0]) is None:
        return f"no C compiler ({' '.join(compiler) or 'cc'})"
    include = sysconfig.get_paths().get("include", "")
    if not (Path(include) / "Python.h").exists():
        return f"no Python headers in {include}"
    try:
        import mypyc.build  # noqa: F401
    except ImportError:
        return "mypyc is not installed"
    return ""


#: The digest of the sources mypyc compiled (set by :func:`ext_modules`).
_COMPILED_FROM: str | None = None


class BuildExtWithDigest(build_ext):
    """build_ext that records, once every extension is built, which sources they were
    built from (txbroker._build falls back to the sources when they differ)."""

    def run(self) -> None:
        super().run()
        if not self.extensions or _COMPILED_FROM is None:
            return
        digest = _COMPILED_FROM + "\n"
        (PACKAGE / DIGEST_FILE).write_text(digest)
        if not self.inplace:
            built = Path(self.build_lib) / "txbroker"
            built.mkdir(parents=True, exist_ok=True)
            (built / DIGEST_FILE).write_text(digest)


def ext_modules() -> list[Any]:
    # No digest until the build succeeds: extensions left from an older build count
    # as stale meanwhile, and a failed build leaves them so.
    (PACKAGE / DIGEST_FILE).unlink(missing_ok=True)
    why_not = can_compile()
    if why_not:
        print(f"txbroker: building pure Python ({why_not})", file=sys.stderr)
        return []
    from mypyc.build import mypycify

    sources = [str(p.relative_to(ROOT)) for p in compiled_sources(PACKAGE)]
    global _COMPILED_FROM
    # the digest of what mypyc reads now (a source edited while the C compiles makes
    # the build stale at once, instead of passing the edit off as compiled)
    _COMPILED_FROM = sources_digest(PACKAGE)
    print(f"txbroker: compiling {len(sources)} modules of {', '.join(COMPILED)} with mypyc",
          file=sys.stderr)
    return list(mypycify(sources, opt_level="3", group_name="txbroker_native"))


setup(ext_modules=ext_modules(), cmdclass={"build_ext": BuildExtWithDigest})

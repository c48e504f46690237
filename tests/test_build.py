"""The compiled and pure builds of the hot path (txbroker._build, setup.py).

``make test`` runs the whole suite on the build the install made, then the compiled
set's own tests again with ``TXBROKER_PURE=1``.
"""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import txbroker
from txbroker import _build

PACKAGE = Path(txbroker.__file__).resolve().parent
EXT = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def has_extensions() -> bool:
    return any(p.name.endswith(EXT) for p in (PACKAGE / "core").iterdir())


def can_compile() -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return shutil.which(cc) is not None and headers.exists()


def probe(env: dict[str, str], package_parent: Path | None = None) -> list[str]:
    """MODE and where txbroker.core.queues came from, in a fresh interpreter."""
    code = ("import txbroker, txbroker._build as b, txbroker.core.queues as q, "
            "txbroker.protocol.native as n; print(b.MODE); print(q.__file__); "
            "print(n.__file__)")
    full_env = {k: v for k, v in os.environ.items() if k != _build.PURE_ENV}
    full_env.update(env)
    if package_parent is not None:
        full_env["PYTHONPATH"] = str(package_parent)
    out = subprocess.run([sys.executable, "-c", code], env=full_env, check=True,
                         capture_output=True, text=True).stdout
    return out.splitlines()


def test_this_run_uses_the_build_it_asks_for() -> None:
    """Without TXBROKER_PURE, a machine that can compile runs the compiled modules
    (the install compiled them); with it, the pure sources."""
    import txbroker.core.queues as queues

    asked_pure = os.environ.get(_build.PURE_ENV, "") not in ("", "0")
    if not has_extensions():  # a pure install: no compiler, or TXBROKER_PURE=1 at install
        assert asked_pure or not can_compile(), \
            "a C compiler is here, yet the install compiled nothing"
        assert _build.MODE == "pure"
        assert queues.__file__.endswith(".py")
    elif asked_pure:
        assert _build.MODE == "pure (TXBROKER_PURE=1)"
        assert queues.__file__.endswith(".py")
    else:
        assert _build.MODE == "compiled"
        assert queues.__file__.endswith(EXT)


@pytest.mark.skipif(not has_extensions(), reason="the install is pure Python")
def test_pure_env_loads_every_module_from_source() -> None:
    mode, queues, native = probe({_build.PURE_ENV: "1"})
    assert mode == "pure (TXBROKER_PURE=1)"
    assert queues.endswith("core/queues.py") and native.endswith("protocol/native.py")
    mode, queues, native = probe({_build.PURE_ENV: "0"})
    assert mode == "compiled"
    assert queues.endswith(EXT) and native.endswith(EXT)


@pytest.mark.skipif(not has_extensions(), reason="the install is pure Python")
def test_a_stale_build_falls_back_to_the_sources(tmp_path: Path) -> None:
    """After an edit of one compiled module, every module of the set comes from its
    source (compiled modules call each other natively: no mixing)."""
    copy = tmp_path / "txbroker"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for lib in PACKAGE.parent.glob("txbroker_native__mypyc*"):
        shutil.copy2(lib, tmp_path / lib.name)
    assert probe({}, tmp_path)[0] == "compiled"
    source = copy / "core" / "queues.py"
    source.write_text(source.read_text() + "\n# edited\n")
    mode, queues, native = probe({}, tmp_path)
    assert mode.startswith("pure (stale build")
    assert queues == str(source) and native == str(copy / "protocol" / "native.py")


def test_digest_covers_exactly_the_compiled_set() -> None:
    names = {p.relative_to(PACKAGE).as_posix() for p in _build.compiled_sources()}
    assert "core/queues.py" in names and "protocol/stomp.py" in names
    assert {"core/router/__init__.py", "core/router/engine.py",
            "core/router/states.py"} <= names  # the router package (issue 26 §3)
    assert {"storage/journal_format.py", "storage/journal_scan.py",
            "storage/dirstore_format.py"} <= names
    assert {n for n in names if n.startswith("server/")} == {
        "server/ops/__init__.py", "server/ops/operations.py", "server/ops/seams.py",
        "server/ops/session.py", "server/ops/values.py", "server/edges/stomp/frames.py"}
    assert not any(n.startswith("client/") for n in names)
    assert "storage/journal.py" not in names
    assert len(_build.sources_digest()) == 64


def test_an_install_without_a_c_compiler_is_pure_python(tmp_path: Path) -> None:
    """setup.py on a machine whose C compiler is missing ($CC names nothing) builds a
    pure-Python wheel, and that wheel's ``txbroker`` runs the sources."""
    tree = tmp_path / "tree"
    tree.mkdir()
    root = PACKAGE.parent.parent
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(root / name, tree / name)
    shutil.copytree(PACKAGE.parent, tree / "src", ignore=shutil.ignore_patterns(
        "*.so", "*.pyd", "__pycache__", _build.DIGEST_FILE, "*.egg-info",
        "txbroker_native__mypyc*"))
    env = {k: v for k, v in os.environ.items() if k != _build.PURE_ENV}
    env["CC"] = str(tmp_path / "no-such-compiler")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(tmp_path / "out"),
         str(tree)], env=env, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    assert "txbroker: building pure Python (no C compiler" in built.stdout + built.stderr
    (wheel,) = (tmp_path / "out").glob("txbroker-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    installed = tmp_path / "installed"
    shutil.unpack_archive(wheel, installed, "zip")
    names = {p.relative_to(installed).as_posix() for p in installed.rglob("*")}
    assert "txbroker/core/queues.py" in names and "txbroker/protocol/native.py" in names
    assert not [n for n in names if n.endswith(EXT) or n.endswith(_build.DIGEST_FILE)]
    mode, queues, native = probe({}, installed)
    assert mode == "pure"
    assert queues == str(installed / "txbroker" / "core" / "queues.py")
    assert native == str(installed / "txbroker" / "protocol" / "native.py")


def test_the_compiled_set_is_named_once() -> None:
    """The Makefile's install dependencies and its pure-Python test pass come from
    ``_build.py`` (run as a script), not from a second list."""
    root = PACKAGE.parent.parent
    makefile = (root / "Makefile").read_text()
    assert "$(shell $(PYTHON) src/txbroker/_build.py sources)" in makefile
    assert "$(shell $(PYTHON) src/txbroker/_build.py pure-tests)" in makefile
    assert "TXBROKER_PURE=1 $(PY) -m pytest -q -p no:cacheprovider $(PURE_TESTS)" in makefile
    out = subprocess.run([sys.executable, str(PACKAGE / "_build.py"), "sources"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [f"src/txbroker/{p.relative_to(PACKAGE).as_posix()}"
                   for p in _build.compiled_sources()]
    out = subprocess.run([sys.executable, str(PACKAGE / "_build.py"), "pure-tests"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == list(_build.PURE_TESTS) and all((root / t).exists() for t in out)

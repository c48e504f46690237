"""The console's static files: served under /console/ (no login needed: they hold
no data), / redirects there, and pyproject.toml ships every one of them."""

from __future__ import annotations

import fnmatch
import re
import tomllib

from tests.http.conftest import HttpBroker
from tests.support import ROOT
from txbroker.server.edges.http.console import STATIC_DIR


def test_root_redirects_to_the_console(secured: HttpBroker) -> None:
    response = secured.http.get("/")
    assert response.status_code == 307
    assert response.headers["location"] == "/console/"


def test_console_files_are_served_without_credentials(secured: HttpBroker) -> None:
    http = secured.http
    page = http.get("/console/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="js/app.js">' in page.text
    script = http.get("/console/js/app.js")
    assert script.status_code == 200
    assert "javascript" in script.headers["content-type"]
    assert http.get("/console/console.css").headers["content-type"].startswith("text/css")
    assert http.get("/console/nothing.js").status_code == 404
    assert http.get("/console/../api/overview").status_code in (401, 404)


def test_every_module_the_console_imports_is_there() -> None:
    """No reference to a file that is not shipped, and nothing from another host."""
    for path in STATIC_DIR.rglob("*"):
        if path.suffix not in (".js", ".html", ".css"):
            continue
        text = path.read_text()
        assert "http://" not in text and "https://" not in text, path  # no CDN
        for target in re.findall(r'from "(\.[^"]+)"', text):
            assert (path.parent / target).resolve().is_file(), (path, target)


def test_pyproject_ships_every_static_file() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["txbroker"]
    package = ROOT / "src" / "txbroker"
    for path in STATIC_DIR.rglob("*"):
        if path.is_file():
            relative = path.relative_to(package).as_posix()
            assert any(fnmatch.fnmatch(relative, p) and relative.count("/") == p.count("/")
                       for p in patterns), relative

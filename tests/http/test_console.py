"""The web console in a real browser: Debian's chromium, headless, driven by
Selenium through Debian's chromedriver, against a real broker process with a
user (so the login is exercised) and an open one.

One browser for the module; every wait is on the page's DOM (an element's text)
with a generous timeout, never a fixed sleep. A screenshot of each step goes
to ``test-artifacts/console/`` (the path is printed in the test output).
Skipped only when chromium or chromedriver is not installed; ``make test``
installs both.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import txbroker
from tests.http.conftest import PASSWORD, USER, HttpBroker, dead_letter_two, start
from tests.support import ROOT

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
    pytest.skip("Debian's chromium and chromium-driver are not installed "
                "(make test installs them: apt-get install chromium chromium-driver)",
                allow_module_level=True)

from selenium import webdriver  # noqa: E402 - after the skip
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webelement import WebElement  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

#: Seconds to wait for the page to show something (the console polls every 1-2 s;
#: a loaded CI machine can be slow to start a browser or answer).
WAIT = 30.0
#: Where the screenshots go.
ARTIFACTS = ROOT / "test-artifacts" / "console"


class Page:
    """The browser on one broker's console, with waits on the DOM."""

    def __init__(self, driver: webdriver.Chrome, base: str) -> None:
        self.driver = driver
        self.base = base
        self.shots: list[Path] = []

    def open(self, route: str) -> None:
        """Go to a hash route (``#/queues``) of the console."""
        self.driver.get(f"{self.base}/console/{route}")

    def until(self, check: Callable[[], Any], what: str) -> Any:
        """Wait until ``check()`` is truthy (a stale element just means: not yet)."""
        def attempt(_: Any) -> Any:
            try:
                return check()
            except StaleElementReferenceException:
                return False
        return WebDriverWait(self.driver, WAIT, poll_frequency=0.1).until(
            attempt, f"timed out waiting for {what}")

    def find(self, css: str) -> WebElement:
        """The first element matching ``css`` once it is displayed."""
        def shown() -> WebElement | None:
            found = self.driver.find_elements(By.CSS_SELECTOR, css)
            return found[0] if found and found[0].is_displayed() else None
        element: WebElement = self.until(shown, f"{css} to be shown")
        return element

    def text(self, css: str, expected: str) -> None:
        """Wait until the element's text is exactly ``expected``."""
        last: list[str] = []

        def matches() -> bool:
            found = self.driver.find_elements(By.CSS_SELECTOR, css)
            last[:] = [e.text for e in found]
            return bool(found) and found[0].text.strip() == expected
        try:
            self.until(matches, f"{css} to read {expected!r}")
        except Exception as exc:
            raise AssertionError(f"{css}: wanted {expected!r}, the page shows {last}") from exc

    def contains(self, css: str, expected: str) -> WebElement:
        """Wait until an element matching ``css`` contains ``expected``."""
        def search() -> WebElement | None:
            for element in self.driver.find_elements(By.CSS_SELECTOR, css):
                if expected in element.text:
                    return element
            return None
        element: WebElement = self.until(search, f"{css} containing {expected!r}")
        return element

    def confirm(self, expected_title: str, shot: str) -> None:
        """Accept the confirmation dialog, after checking what it asks."""
        self.contains("#confirm-title", expected_title)
        self.shot(f"confirm-{shot}")
        self.find("#confirm-ok").click()
        self.until(lambda: not self.driver.find_element(By.ID, "confirm").is_displayed(),
                   "the dialog to close")

    def shot(self, name: str) -> None:
        """A screenshot of the page now."""
        taken = len(list(ARTIFACTS.glob("*.png")))  # numbered across the module
        path = ARTIFACTS / f"{taken + 1:02d}-{name}.png"
        self.driver.save_screenshot(str(path))
        self.shots.append(path)


def chrome() -> webdriver.Chrome:
    """Headless chromium through Debian's chromedriver: both paths are explicit, so
    Selenium Manager has nothing to download."""
    os.environ.setdefault("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1400,1000", "--lang=en-US",
                     "--disable-extensions", "--no-first-run"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)),
                            options=options)


@pytest.fixture(scope="module")
def driver(request: pytest.FixtureRequest) -> Iterator[webdriver.Chrome]:
    """One browser for the module."""
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if capture is not None and reporter is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\nconsole screenshots: {ARTIFACTS}")
    browser = chrome()
    browser.set_page_load_timeout(WAIT)
    yield browser
    browser.quit()


@pytest.fixture(scope="module")
def page(driver: webdriver.Chrome, secured: HttpBroker) -> Page:
    """The console of the broker with users (logged in by the first test)."""
    return Page(driver, f"http://127.0.0.1:{secured.http_port}")


def native_url(broker: HttpBroker) -> str:
    """The native URL with the user's credentials."""
    return broker.url.replace("txb://", f"txb://{USER}:{PASSWORD}@")


def test_login_refuses_a_wrong_password_then_logs_in(page: Page) -> None:
    page.driver.get(page.base + "/")  # redirects to /console/, which asks for a login
    page.find("#login-user").send_keys(USER)
    page.find("#login-password").send_keys("wrong")
    page.find("#login-submit").click()
    page.contains("#login-error", "Login refused")
    page.shot("login-refused")
    password = page.find("#login-password")
    password.clear()
    password.send_keys(PASSWORD)
    page.find("#login-submit").click()
    page.text("#user", f"signed in as {USER}")
    page.find("#d-uptime")
    page.until(lambda: page.driver.find_element(By.ID, "d-store").text == "journal",
               "the dashboard's store card")
    page.shot("dashboard")
    # log out, and in again: the credentials live in sessionStorage only
    page.find("#logout").click()
    page.find("#login-user").send_keys(USER)
    assert page.driver.execute_script("return sessionStorage.length") == 0
    page.find("#login-password").send_keys(PASSWORD)
    page.find("#login-submit").click()
    page.text("#user", f"signed in as {USER}")


def test_queue_depth_follows_sends(page: Page, secured: HttpBroker) -> None:
    with txbroker.connect(native_url(secured)) as conn:
        conn.declare_queue("orders")
        page.open("#/queues/orders")
        page.text("#q-depth", "0")
        for n in range(3):
            conn.send("orders", b"order %d" % n)
        page.text("#q-depth", "3")
        page.shot("queue-depth-3")
        with conn.transaction() as tx:
            for n in range(1200):
                tx.send("orders", b"bulk %d" % n)
        page.text("#q-depth", "1,203")  # thousands separators
        page.shot("queue-depth-1203")
    page.open("#/queues")
    page.find("#queue-filter").send_keys("ord")
    page.text('#queue-rows tr[data-queue="orders"] td[data-field="depth"]', "1,203")
    page.text("#queue-count", "1 match")
    page.shot("queue-list")


def test_dashboard_charts_live_rates(page: Page, secured: HttpBroker) -> None:
    """Messages sent while the dashboard is open show as a rate above 0 per second."""
    stop = threading.Event()

    def traffic() -> None:
        with txbroker.connect(native_url(secured)) as conn:
            conn.declare_queue("dash")
            while not stop.is_set():
                conn.send("dash", b"tick")
                message = conn.receive("dash", timeout=5)
                if message is not None:
                    message.ack()
    sender = threading.Thread(target=traffic, daemon=True)
    page.open("#/")
    page.find("#d-uptime")
    sender.start()
    try:
        page.until(lambda: page.driver.find_element(By.ID, "now-sent").text not in ("–", "0"),
                   "a sent rate above 0")
        page.until(lambda: page.driver.find_element(By.ID, "now-syncs").text not in ("–", "0"),
                   "a store sync rate above 0")
        for chart in ("chart-sent", "chart-syncs"):  # a line of several points drawn
            page.until(lambda c=chart: int(page.driver.find_element(By.ID, c)
                                           .get_attribute("data-points") or 0) >= 4,
                       f"{chart} to have 4 points")
        page.shot("dashboard-traffic")
    finally:
        stop.set()
        sender.join(timeout=30)


def test_change_settings_then_delete(page: Page, secured: HttpBroker) -> None:
    with txbroker.connect(native_url(secured)) as conn:
        conn.declare_queue("tuned", max_messages=10)
        conn.send("tuned", b"x")
    page.open("#/queues/tuned")
    limit = page.find("#setting-max_messages")
    page.until(lambda: limit.get_attribute("value") == "10", "the settings form")
    limit.clear()
    limit.send_keys("25")
    page.find("#setting-ingress").click()
    page.find("#settings-save").click()
    page.contains("#notice", "Saved: max_messages, ingress")
    settings = secured.http.get("/api/queues/tuned", auth=(USER, PASSWORD)).json()["settings"]
    assert (settings["max_messages"], settings["ingress"]) == (25, False)
    limit.clear()
    limit.send_keys("-1")
    page.find("#settings-save").click()
    page.contains("#notice", "must be an integer >= 0 (BAD_REQUEST, HTTP 400)")
    page.shot("settings-refused")
    page.find("#delete").click()
    page.confirm("Delete tuned?", "delete")
    page.find("#queue-filter")  # back on the list
    assert secured.http.get("/api/queues/tuned", auth=(USER, PASSWORD)).status_code == 404


def test_queue_list_pages_sorts_and_filters(page: Page, secured: HttpBroker) -> None:
    with txbroker.connect(native_url(secured)) as conn:
        for n in range(30):
            conn.declare_queue(f"paged.{n:02d}")
        conn.send("paged.07", b"deepest")
        conn.send("paged.07", b"deepest")
        conn.send("paged.13", b"deep")
    page.open("#/queues")
    Select(page.find("#queue-page-size")).select_by_value("25")
    filter_box = page.find("#queue-filter")
    filter_box.clear()
    filter_box.send_keys("PAGED.")
    page.text("#queue-count", "30 matches")
    page.text("#queue-page", "page 1 of 2")
    page.find('#queue-rows tr[data-queue="paged.24"]')
    page.find("#queue-next").click()
    page.text("#queue-page", "page 2 of 2")
    page.find('#queue-rows tr[data-queue="paged.29"]')
    assert len(page.driver.find_elements(By.CSS_SELECTOR, "#queue-rows tr")) == 5
    page.find('th[data-sort="depth"]').click()  # a count: largest first
    page.text("#queue-page", "page 1 of 2")
    page.text("#queue-rows tr:nth-child(1) td:first-child", "paged.07")
    page.text("#queue-rows tr:nth-child(2) td:first-child", "paged.13")
    page.shot("queue-list-sorted")
    page.find('th[data-sort="name"]').click()  # back to names, for the later tests


def test_browse_shows_headers_and_body(page: Page, secured: HttpBroker) -> None:
    with txbroker.connect(native_url(secured)) as conn:
        conn.declare_queue("browsed")
        conn.send("browsed", b'{"amount": 10}', headers={"origin": "shop"}, message_id="pay-1")
        conn.send("browsed", b"\x00\xffbin", priority=0)
    page.open("#/queues/browsed")
    page.text("#q-depth", "2")
    page.find("#browse").click()
    page.contains("#messages pre.body", '{"amount": 10}')
    page.contains("#messages pre.headers", '"origin": "shop"')
    page.contains("#messages .meta", "pay-1")
    page.contains("#messages pre.body", "00 ff 62 69 6e")  # the binary one, in hex
    page.shot("browse")
    page.text("#q-depth", "2")  # nothing consumed


def test_purge_asks_then_empties_the_queue(page: Page, secured: HttpBroker) -> None:
    with txbroker.connect(native_url(secured)) as conn:
        conn.declare_queue("purged")
        for n in range(4):
            conn.send("purged", b"m%d" % n)
    page.open("#/queues/purged")
    page.text("#q-depth", "4")
    page.find("#purge").click()
    page.confirm("Purge purged?", "purge")
    page.contains("#notice", "Purged 4 message(s)")
    page.text("#q-depth", "0")
    page.shot("purged")


def test_redrive_a_dead_letter_queue(page: Page, secured: HttpBroker) -> None:
    dead_letter_two(native_url(secured))
    with txbroker.connect(native_url(secured)) as conn:
        page.open("#/queues/work.dlq")
        page.text("#q-depth", "2")
        page.contains("#redrive-origin", "dead-letter or expiry queue of work")
        page.find("#move").click()
        page.confirm("Move messages from work.dlq?", "move")
        page.contains("#notice", "Moved 2 message(s) to work")
        page.text("#q-depth", "0")
        page.shot("redriven-dlq")
        page.open("#/queues/work")
        page.text("#q-depth", "2")
        page.shot("redriven-origin")
        again = conn.receive("work", timeout=10)
        assert again is not None and again.body == b"a"
        again.ack()


def test_heuristic_rollback_of_a_prepared_branch(page: Page, secured: HttpBroker) -> None:
    with txbroker.connect(native_url(secured)) as conn:
        conn.declare_queue("xa-console")
        xid = conn.xid(7, b"console-gtrid", b"b1")
        conn.tpc_begin(xid)
        conn.send("xa-console", b"in doubt")
        conn.tpc_prepare()
    row = f'#xa-rows tr[data-xid="{xid}"]'
    page.open("#/xa")
    page.text(f'{row} td[data-field="state"]', "prepared")
    page.shot("xa-prepared")
    page.find(f'{row} button[data-act="rollback"]').click()
    page.confirm(f"Heuristically roll back {xid}?", "xa-rollback")
    page.text(f'{row} td[data-field="state"]', "heuristic rolled back")
    page.until(lambda: page.find(f'{row} button[data-act="forget"]').is_enabled(),
               "forget to be enabled")
    page.shot("xa-heuristic-rollback")
    page.find(f'{row} button[data-act="forget"]').click()
    page.confirm(f"Forget {xid}?", "xa-forget")
    page.until(lambda: not page.driver.find_elements(By.CSS_SELECTOR, row), "the row to go")
    page.open("#/queues/xa-console")
    page.text("#q-depth", "0")


def test_router_page_shows_partitions_and_discards_an_exception(
        page: Page, secured: HttpBroker) -> None:
    """Issue 28 §2: the router in the console: partitions with their servers, and an
    exception transaction (retry count 0, its server left before voting) discarded."""
    from txbroker.router import ServerTransactionController, TransactionController

    url = native_url(secured)
    with txbroker.connect(url) as conn:
        conn.request("rtr_define", {"facility": "CONSOLE", "partitions": [
            {"name": "P", "low": 0, "high": 99, "retry_count": 0}]})
    with TransactionController(url) as client:
        client.register_facility("CONSOLE")
        with ServerTransactionController(url) as server:
            server.register_partition("CONSOLE", "P")
            page.open("#/router")
            page.contains('#router-partitions tr[data-partition="CONSOLE/P"]', "primary")
            page.shot("router-partitions")
            tid = client.start_transaction()
            client.send(b"poison", key=1)
            client.accept()
            assert server.receive(timeout=30) is not None
        message = client.receive(timeout=30)
        assert message is not None and message.reason == "SRVDIED"
    row = f'#router-exceptions tr[data-tid="{tid}"]'
    page.contains(row, "CONSOLE")
    page.shot("router-exception")
    page.find(f'{row} button[data-act="discard"]').click()
    page.confirm(f"Discard {tid}?", "router-discard")
    page.until(lambda: not page.driver.find_elements(By.CSS_SELECTOR, row), "the row to go")


def test_close_a_connection(page: Page, secured: HttpBroker) -> None:
    with txbroker.connect(native_url(secured), reconnect=False) as conn:
        conn.declare_queue("closing")
        sub = conn.subscribe("closing", prefetch=1)
        page.open("#/connections")

        def subscriber() -> WebElement | None:  # the one connection with a subscription
            for found in page.driver.find_elements(By.CSS_SELECTOR, "#connection-rows tr"):
                cells = found.find_elements(By.TAG_NAME, "td")
                if cells[3].text.startswith("127.0.0.1:") and cells[5].text == "1":
                    return found
            return None
        row: WebElement = page.until(subscriber, "the subscriber's row")
        key = row.get_attribute("data-connection")
        page.shot("connections")
        row.find_element(By.TAG_NAME, "button").click()
        page.confirm(f"Close connection {key}?", "close")
        page.until(lambda: not page.driver.find_elements(
            By.CSS_SELECTOR, f'#connection-rows tr[data-connection="{key}"]'), "the row to go")
        page.until(lambda: secured.http.get("/api/queues/closing", auth=(USER, PASSWORD))
                   .json()["consumers"] == 0, "the consumer to go")
        del sub


@pytest.fixture(scope="module")
def amqp_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpBroker]:
    """An open broker with the AMQP listener too."""
    running = start(tmp_path_factory.mktemp("http-amqp") / "data", amqp=True)
    yield running
    running.http.close()
    running.process.kill()


def test_amqp_channels_are_listed(driver: webdriver.Chrome, amqp_broker: HttpBroker) -> None:
    """An AMQP connection's channels: number, consumers, prefetch, unacked, mode."""
    import pika

    page = Page(driver, f"http://127.0.0.1:{amqp_broker.http_port}")
    conn = pika.BlockingConnection(pika.URLParameters(
        f"amqp://guest:guest@127.0.0.1:{amqp_broker.amqp_port}/"))
    try:
        confirming = conn.channel()
        confirming.confirm_delivery()
        consuming = conn.channel()
        consuming.queue_declare("console-amqp")
        for body in (b"a", b"b"):
            confirming.basic_publish("", "console-amqp", body)
        consuming.basic_qos(prefetch_count=5)
        got: list[object] = []
        consuming.basic_consume("console-amqp", lambda *a: got.append(a),
                                consumer_tag="console-tag")
        consuming.tx_select()
        while len(got) < 2:
            conn.process_data_events(time_limit=0.1)
        page.open("#/connections")
        (connection,) = [c["id"] for c in amqp_broker.http.get("/api/connections").json()
                         if c["protocol"] == "amqp"]
        for channel, cells in ((confirming.channel_number, ["0", "–", "0", "0", "confirm"]),
                               (consuming.channel_number, ["1", "console-tag", "5", "2", "tx"])):
            row = f'#channel-rows tr[data-channel="{connection}:{channel}"]'
            page.find(row)
            wanted = [str(connection), str(channel), *cells]
            page.until(lambda row=row, wanted=wanted: [
                td.text for td in page.driver.find_elements(By.CSS_SELECTOR, f"{row} td")
            ] == wanted, f"{row} to show {wanted}")
        page.shot("amqp-channels")
        consuming.close()
        page.until(lambda: not page.driver.find_elements(
            By.CSS_SELECTOR, f'#channel-rows tr[data-channel="{connection}:'
            f'{consuming.channel_number}"]'), "the closed channel's row to go")
    finally:
        conn.close()


def test_api_errors_are_shown(page: Page) -> None:
    page.open("#/queues/no-such-queue")
    page.contains("#queue-error", "no queue 'no-such-queue' (NOT_FOUND, HTTP 404)")
    page.shot("api-error")


def test_an_open_broker_needs_no_login(driver: webdriver.Chrome, broker: HttpBroker) -> None:
    open_page = Page(driver, f"http://127.0.0.1:{broker.http_port}")
    open_page.open("#/")
    open_page.contains("#open-broker", "open broker")
    open_page.find("#d-uptime")
    assert not driver.find_elements(By.ID, "logout")
    open_page.shot("open-broker")

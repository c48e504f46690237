"""A Celery app (kombu + py-amqp underneath), unchanged but for ``broker_url``,
with its worker in this process: tasks run and are acknowledged late; the broker is
killed with -9 under it and restarted, and every task still completes."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from tests.amqp.support import AmqpBroker

WAIT = 60.0


def make_app(url: str, done: dict[int, list[bool]], lock: threading.Lock) -> Celery:
    app = Celery("txbroker-tests", broker=url)
    app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1,
                    broker_transport_options={"confirm_publish": True},
                    broker_connection_retry=True, broker_connection_max_retries=None,
                    worker_hijack_root_logger=False, task_default_queue=f"celery-{id(done)}",
                    # without AMQP heartbeats: with them (Celery's default asks for 120 s,
                    # 60 s is agreed) the worker's shutdown waits for the next frame, up to
                    # half an interval, as it does against RabbitMQ
                    broker_heartbeat=0,
                    # a task running when the connection is lost is redelivered (its ack
                    # cannot reach the broker): Celery 6's default, said explicitly
                    worker_cancel_long_running_tasks_on_connection_loss=True)

    @app.task(name=f"record-{id(done)}", bind=True)
    def record(self: object, n: int) -> int:
        redelivered = bool(self.request.delivery_info.get("redelivered"))  # type: ignore[attr-defined]
        with lock:
            done.setdefault(n, []).append(redelivered)
        return n

    return app


def wait_for(condition: object, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[AmqpBroker]:
    made = AmqpBroker(tmp_path / "data").start()
    yield made
    made.kill()


def test_celery_worker_runs_tasks(broker: AmqpBroker) -> None:
    done: dict[int, list[bool]] = {}
    lock = threading.Lock()
    app = make_app(broker.amqp_url, done, lock)
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING",
                      shutdown_timeout=30):
        for n in range(20):
            app.tasks[f"record-{id(done)}"].delay(n)
        wait_for(lambda: len(done) == 20)
    assert sorted(done) == list(range(20))
    assert all(runs == [False] for runs in done.values())


def test_celery_survives_kill9_of_the_broker(broker: AmqpBroker) -> None:
    done: dict[int, list[bool]] = {}
    lock = threading.Lock()
    app = make_app(broker.amqp_url, done, lock)
    count = 40
    for n in range(count):  # confirmed publishes: durable before delay() returns
        app.tasks[f"record-{id(done)}"].delay(n)
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING",
                      shutdown_timeout=30):
        wait_for(lambda: len(done) >= 5)
        broker.kill(signal.SIGKILL)
        broker.start()
        wait_for(lambda: len(done) == count)
    assert sorted(done) == list(range(count))
    # a task that ran twice was redelivered the second time
    assert all(runs[1:] == [True] * (len(runs) - 1) for runs in done.values())

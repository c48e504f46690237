"""``/metrics``: one Prometheus collector that reads the live broker at scrape time.

No counter is kept twice: every value comes, when Prometheus scrapes, from
what the operation layer and the native ops already read — the queue list
(``queue_list``: depth, in-flight, consumers, bytes, and the per-queue counts
since start), the server's stats (``stats``: core counters, store counters,
HA status), the connections (``Operations.connections``), the XA branches
(``xa_list``) — and from the store's writer-thread histograms
(``StoreStats.batch_seconds``/``batch_entries``). Names follow the Prometheus
conventions: a ``txbroker_`` prefix, base units (seconds, bytes), ``_total``
on counters (added by the client library), one label per dimension.

A scrape reads the state on the loop into a :class:`Snapshot` of plain data
(the reads above return fresh dicts); building the families and formatting
them then runs on a worker thread (``api.py``): with 10,000 queues reading
takes about a fifth of the time and the loop is free for the rest.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from txbroker._version import __version__
from txbroker.core.xa import BranchState

if TYPE_CHECKING:
    from txbroker.server.edges.http.calls import HttpServerPort
    from txbroker.storage.interface import Histogram, StoreStats

#: Per-queue gauges: (metric, queue_info key, help).
QUEUE_GAUGES: Final = (
    ("txbroker_queue_messages", "depth", "Messages waiting in the queue (ready + scheduled)."),
    ("txbroker_queue_messages_in_flight", "in_flight", "Messages delivered and not yet acked."),
    ("txbroker_queue_messages_scheduled", "scheduled", "Messages waiting for their time."),
    ("txbroker_queue_bytes", "bytes", "Body bytes of the queue's messages."),
    ("txbroker_queue_consumers", "consumers", "Consumers (subscriptions) of the queue."),
)
#: Per-queue counters since the broker started (``_total`` is added).
QUEUE_COUNTERS: Final = (
    ("txbroker_queue_enqueued", "enqueued", "Messages that entered the queue."),
    ("txbroker_queue_dequeued", "dequeued", "Messages consumed (acked) from the queue."),
    ("txbroker_queue_expired", "expired", "Messages whose time to live ran out."),
    ("txbroker_queue_dead_lettered", "dead_lettered", "Messages dead-lettered."),
)
#: Broker-wide counters of the core (stats key, help).
BROKER_COUNTERS: Final = (
    ("sent", "Messages accepted from senders."),
    ("delivered", "Deliveries made to consumers."),
    ("acked", "Messages consumed."),
    ("expired", "Messages expired."),
    ("dead_lettered", "Messages dead-lettered."),
)
#: XA branch states always exported (0 when none): core/xa.py's states.
XA_STATES: Final = tuple(s.value for s in BranchState
                         if s not in (BranchState.NONE, BranchState.GONE))
PROTOCOLS: Final = ("native", "stomp", "http", "amqp")
#: The modes of an AMQP channel (``server/edges/amqp/channel.py`` ``Channel.describe``).
AMQP_CHANNEL_MODES: Final = ("none", "confirm", "tx")


@dataclass(frozen=True)
class HistogramReading:
    """A store histogram's cumulative buckets and sum, read at one moment."""

    buckets: list[tuple[float, int]]
    total: float

    @classmethod
    def of(cls, histogram: Histogram | None) -> HistogramReading | None:
        """Read ``histogram`` (None stays None)."""
        if histogram is None:
            return None
        return cls(histogram.cumulative(), histogram.total)

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        """As a Prometheus histogram."""
        buckets = [("+Inf" if bound == float("inf") else repr(float(bound)), count)
                   for bound, count in self.buckets]
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=self.total)


@dataclass(frozen=True)
class Snapshot(Collector):
    """What a scrape reads, at one moment, as plain data (fresh dicts and
    numbers): building the metric families and formatting them — most of the
    time of a scrape of many queues — can then run off the loop."""

    queues: list[dict[str, Any]]
    stats: dict[str, Any]
    store: StoreStats | None
    batch_seconds: HistogramReading | None
    batch_entries: HistogramReading | None
    connections: Counter[str]
    xa_states: Counter[str]
    store_kind: str
    sync: str
    #: AMQP channels open, by mode ("none", "confirm", "tx")
    amqp_channels: Counter[str] = field(default_factory=Counter)

    def collect(self) -> Iterator[Metric]:
        """Every metric family."""
        yield from self._queues()
        yield from self._broker()
        yield from self._store()
        connections = GaugeMetricFamily("txbroker_connections", "Open client connections.",
                                        labels=["protocol"])
        for protocol in sorted(set(PROTOCOLS) | set(self.connections)):
            connections.add_metric([protocol], self.connections.get(protocol, 0))
        yield connections
        channels = GaugeMetricFamily("txbroker_amqp_channels",
                                     "Open AMQP channels, by mode (none, confirm, tx).",
                                     labels=["mode"])
        for mode in sorted(set(AMQP_CHANNEL_MODES) | set(self.amqp_channels)):
            channels.add_metric([mode], self.amqp_channels.get(mode, 0))
        yield channels
        branches = GaugeMetricFamily("txbroker_xa_branches", "XA branches by state.",
                                     labels=["state"])
        for state in sorted(set(XA_STATES) | set(self.xa_states)):
            branches.add_metric([state], self.xa_states.get(state, 0))
        yield branches
        yield from self._ha(self.stats.get("ha"))
        yield from self._router(self.stats.get("router"))

    def _queues(self) -> Iterator[Metric]:
        queues = [info for info in self.queues if info["kind"] == "queue"]
        for name, key, doc in QUEUE_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["queue"])
            for info in queues:
                family.add_metric([info["name"]], info[key])
            yield family
        for name, key, doc in QUEUE_COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=["queue"])
            for info in queues:
                counter.add_metric([info["name"]], info[key])
            yield counter

    def _broker(self) -> Iterator[Metric]:
        stats = self.stats
        info = GaugeMetricFamily("txbroker_info", "The broker's version, store and sync mode.",
                                 labels=["version", "store", "sync"])
        info.add_metric([__version__, self.store_kind, self.sync], 1)
        yield info
        yield GaugeMetricFamily("txbroker_uptime_seconds", "Seconds since the broker started.",
                                value=stats.get("uptime_seconds", 0.0))
        for key, doc in BROKER_COUNTERS:
            yield CounterMetricFamily(f"txbroker_messages_{key}", doc, value=stats.get(key, 0))
        yield GaugeMetricFamily("txbroker_messages", "Messages held by the broker.",
                                value=stats.get("messages", 0))
        yield GaugeMetricFamily("txbroker_queues", "Queues (subscription queues included).",
                                value=stats.get("queues", 0))
        yield GaugeMetricFamily("txbroker_topics", "Topics.", value=stats.get("topics", 0))

    def _store(self) -> Iterator[Metric]:
        store = self.store
        if store is None:
            return
        yield CounterMetricFamily("txbroker_store_appends", "Records appended to the store.",
                                  value=store.appends)
        yield CounterMetricFamily("txbroker_store_syncs",
                                  "Group syncs (fsync/fdatasync, or batches with sync none).",
                                  value=store.syncs)
        yield CounterMetricFamily("txbroker_store_written_bytes", "Bytes written to the store.",
                                  value=store.bytes_written)
        yield GaugeMetricFamily("txbroker_store_disk_bytes", "Bytes the store holds on disk.",
                                value=store.disk_bytes)
        yield GaugeMetricFamily("txbroker_store_segments",
                                "Journal segments (dir store: message files).",
                                value=store.segments)
        yield GaugeMetricFamily("txbroker_store_live_body_bytes", "Bytes of live bodies.",
                                value=store.live_body_bytes)
        yield GaugeMetricFamily("txbroker_store_body_cache_bytes",
                                "Bytes of bodies in the store's LRU body cache.",
                                value=store.body_cache_bytes)
        if self.batch_seconds is not None:
            yield self.batch_seconds.family(
                "txbroker_store_batch_seconds",
                "Time the writer thread took to write and sync one group-commit batch.")
        if self.batch_entries is not None:
            yield self.batch_entries.family("txbroker_store_batch_entries",
                                            "Work items (records) per group-commit batch.")

    @staticmethod
    def _router(router: Any) -> Iterator[Metric]:
        if isinstance(router, dict):
            yield from _router_families(router)

    @staticmethod
    def _ha(status: Any) -> Iterator[Metric]:
        if not isinstance(status, dict):
            return
        role = GaugeMetricFamily("txbroker_ha_role", "1 for this broker's HA role.",
                                 labels=["mode", "role"])
        role.add_metric([str(status.get("mode", "")), str(status.get("role", ""))], 1)
        yield role


def _router_families(router: dict[str, Any]) -> Iterator[Metric]:
    states = GaugeMetricFamily("txbroker_router_transactions",
                               "Transaction router: transactions by router state.",
                               labels=["state"])
    for state, count in sorted(router.get("transactions", {}).items()):
        states.add_metric([state], count)
    yield states
    yield GaugeMetricFamily("txbroker_router_exceptions",
                            "Transaction router: exception transactions waiting for an "
                            "operator.", value=router.get("exceptions", 0))
    yield GaugeMetricFamily("txbroker_router_controllers",
                            "Transaction router: registered client and server controllers.",
                            value=router.get("controllers", 0))
    outcomes = CounterMetricFamily("txbroker_router_outcomes",
                                   "Transaction router: transactions decided since start.",
                                   labels=["outcome"])
    outcomes.add_metric(["committed"], router.get("committed", 0))
    outcomes.add_metric(["rejected"], router.get("rejected", 0))
    yield outcomes
    yield CounterMetricFamily("txbroker_router_replays",
                              "Transaction router: presentations after a server was lost.",
                              value=router.get("replays", 0))


class BrokerCollector(Collector):
    """The broker's metrics, read at each scrape (see the module docstring)."""

    def __init__(self, server: HttpServerPort) -> None:
        self.server = server

    def snapshot(self) -> Snapshot:
        """Read the live state (on the loop: the one place it may be read)."""
        ops = self.server.ops
        store = self.server.store_stats()
        connections = ops.connections()
        return Snapshot(
            queues=ops.broker.queue_list(),
            stats=self.server.stats(),
            store=store,
            batch_seconds=HistogramReading.of(store.batch_seconds if store else None),
            batch_entries=HistogramReading.of(store.batch_entries if store else None),
            connections=Counter(c["protocol"] for c in connections),
            amqp_channels=Counter(channel["mode"] for c in connections
                                  for channel in c["channels"] or ()),
            xa_states=Counter(str(b["state"]) for b in ops.broker.xa_list(ops.now())),
            store_kind=ops.config.store,
            sync=ops.config.sync,
        )

    def collect(self) -> Iterator[Metric]:
        """Every metric family, from the live state."""
        return self.snapshot().collect()


__all__ = ["BrokerCollector", "Snapshot"]

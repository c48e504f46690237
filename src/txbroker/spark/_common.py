"""Options, connections and errors shared by the txbroker Spark connectors.

Spark hands a data source its options as a case-insensitive map of strings
(``DataSource.options``). Everything here turns those strings into checked
values once, on the driver, so that a bad option fails the query before a
task starts, with an error that names the option. Broker refusals met while
connecting or opening a queue are translated at this boundary
(:func:`open_connection`, :func:`queue_error`) into
:class:`SparkConnectorError`, whose text says which option or column is wrong.
No pyspark import here: the workers and the driver both use this module.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from txbroker.errors import (
    AuthenticationFailed,
    BrokerError,
    ConnectionLost,
    NotFound,
    TxBrokerError,
)
from txbroker.xid import MAX_SINK_ID

if TYPE_CHECKING:
    from txbroker.client.sync import Connection

#: Format names registered with Spark.
FORMAT_NAME = "txbroker"

#: Default size of one input partition in sequence numbers (the issue's figure).
DEFAULT_PARTITION_SIZE = 100_000
#: Messages and bytes asked for by one ``stream_read``: the broker's caps
#: (``max_stream_read``, ``max_stream_read_bytes``); a page of small messages then
#: stays under the 8 MiB frame limit. 50,000 rather than 10,000 per page read
#: 123k instead of 92k small JSON messages/s into Arrow (one worker, measured).
READ_PAGE_MESSAGES = 50_000
READ_PAGE_BYTES = 4 * 1024 * 1024
#: One ``send_batch`` carries at most this many body bytes (the 8 MiB frame
#: limit with room for headers and framing) and this many messages.
SEND_CHUNK_BYTES = 4 * 1024 * 1024 - 64 * 1024
SEND_CHUNK_MESSAGES = 10_000
#: Seconds a worker's or the driver's connection waits for a broker answer.
CONNECT_TIMEOUT = 30.0
#: Seconds to keep trying to connect while no broker answers (a broker restart
#: takes a few seconds; the client's own failover waits 30 s by default).
RECONNECT_WAIT = 30.0
#: Pause between two connection attempts.
RECONNECT_PAUSE = 0.5
#: The stream reader name used when the ``name`` option is not given.
DEFAULT_STREAM_NAME = "spark"
#: The stream reader name a consuming batch read attaches with.
DEFAULT_BATCH_CONSUME_NAME = "spark-batch"

BODY_FORMATS = ("binary", "text", "json")
#: The broker's limit on a sink id (``txbroker.xid.MAX_SINK_ID``).
MAX_SINK_ID_BYTES = MAX_SINK_ID


#: The message header that becomes the ``key`` column.
KEY_HEADER = "key"
#: The source's columns in order, with their Spark types (``body``'s follows option
#: ``format``, see :func:`body_ddl`).
SOURCE_COLUMNS: dict[str, str] = {
    "queue": "string",
    "seq": "long",
    "message_id": "string",
    "key": "string",
    "body": "binary",
    "headers": "map<string,string>",
    "timestamp": "timestamp",
    "redelivered": "boolean",
}


def body_ddl(body_format: str, json_schema: str | None) -> str:
    """The Spark type of the ``body`` column for option ``format``."""
    if body_format == "text":
        return "string"
    if body_format == "json":
        assert json_schema is not None
        text = json_schema.strip()
        return text if text.lower().startswith("struct<") else f"struct<{text}>"
    return "binary"


def source_ddl(body_format: str, json_schema: str | None,
               columns: tuple[str, ...] = tuple(SOURCE_COLUMNS)) -> str:
    """The output schema as a DDL string (Spark parses it on the JVM side): the
    given columns, in that order."""
    return ", ".join(
        f"{name} {body_ddl(body_format, json_schema) if name == 'body' else SOURCE_COLUMNS[name]}"
        for name in columns)


class SparkConnectorError(TxBrokerError, ValueError):
    """Bad input to a txbroker Spark connector: a missing or wrong option, an
    unknown queue, refused credentials, a column the sink cannot write. The
    message names the option or column."""


def _clean(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip()
    return value or None


def require(options: Mapping[str, str], key: str, what: str) -> str:
    """The value of a required option (Spark lower-cases option names)."""
    value = _clean(options.get(key.lower()))
    if value is None:
        raise SparkConnectorError(f"option '{key}' is required: {what}")
    return value


def int_option(options: Mapping[str, str], key: str, default: int | None,
               minimum: int = 1) -> int | None:
    """An integer option of at least ``minimum``; ``default`` when absent."""
    raw = _clean(options.get(key.lower()))
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SparkConnectorError(f"option '{key}' must be an integer, not {raw!r}") from None
    if value < minimum:
        raise SparkConnectorError(f"option '{key}' must be at least {minimum}, not {value}")
    return value


def bool_option(options: Mapping[str, str], key: str, default: bool) -> bool:
    """``true``/``false`` (any case); ``default`` when absent."""
    raw = _clean(options.get(key.lower()))
    if raw is None:
        return default
    if raw.lower() in ("true", "1", "yes"):
        return True
    if raw.lower() in ("false", "0", "no"):
        return False
    raise SparkConnectorError(f"option '{key}' must be true or false, not {raw!r}")


def queue_list(options: Mapping[str, str]) -> list[str]:
    """The ``queues`` option: comma-separated names, order kept, duplicates dropped.

    A topic is read through its durable subscription queue ``topic::sub``.
    """
    raw = require(options, "queues", "comma-separated queue names, e.g. 'orders,topic::sub'")
    names: list[str] = []
    for part in raw.split(","):
        name = part.strip()
        if not name:
            raise SparkConnectorError(f"option 'queues' has an empty name: {raw!r}")
        if name not in names:
            names.append(name)
    return names


def column_list(options: Mapping[str, str]) -> tuple[str, ...]:
    """The ``columns`` option: which source columns to produce, in that order (all
    when absent). Spark gives Python data sources no column pruning, and every
    column a query drops still costs a conversion per row on the JVM side."""
    raw = _clean(options.get("columns"))
    if raw is None:
        return tuple(SOURCE_COLUMNS)
    names = [part.strip().lower() for part in raw.split(",")]
    for name in names:
        if name not in SOURCE_COLUMNS:
            raise SparkConnectorError(
                f"option 'columns': {name!r} is not a column of the source; it has "
                f"{', '.join(SOURCE_COLUMNS)}")
    if len(set(names)) != len(names):
        raise SparkConnectorError(f"option 'columns' names a column twice: {raw!r}")
    return tuple(names)


@dataclass(frozen=True)
class ReadOptions:
    """The checked options of a read (batch or streaming)."""

    url: str
    queues: tuple[str, ...]
    name: str
    body_format: str
    json_schema: str | None
    partition_size: int
    max_rows_per_trigger: int | None
    consume: bool
    columns: tuple[str, ...] = tuple(SOURCE_COLUMNS)

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReadOptions:
        """Check every read option (a wrong one raises, naming it)."""
        url = require(options, "url", "the broker URL, e.g. 'txb://127.0.0.1:5445'")
        queues = tuple(queue_list(options))
        body_format = (_clean(options.get("format")) or "binary").lower()
        if body_format not in BODY_FORMATS:
            raise SparkConnectorError(
                f"option 'format' must be one of {', '.join(BODY_FORMATS)}, not {body_format!r}")
        json_schema = _clean(options.get("jsonschema"))
        if body_format == "json" and json_schema is None:
            raise SparkConnectorError(
                "option 'jsonSchema' is required with format=json: a DDL string such as "
                "'id long, name string'")
        consume = bool_option(options, "consume", False)
        default_name = DEFAULT_BATCH_CONSUME_NAME if consume else DEFAULT_STREAM_NAME
        partition_size = int_option(options, "partitionSize", DEFAULT_PARTITION_SIZE)
        assert partition_size is not None
        return cls(
            url=url,
            queues=queues,
            name=_clean(options.get("name")) or default_name,
            body_format=body_format,
            json_schema=json_schema,
            partition_size=partition_size,
            max_rows_per_trigger=int_option(options, "maxRowsPerTrigger", None),
            consume=consume,
            columns=column_list(options),
        )


@dataclass(frozen=True)
class WriteOptions:
    """The checked options of a write."""

    url: str
    queue: str
    sink_id: str | None
    rows_per_branch: int | None = None

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool) -> WriteOptions:
        """Check every write option; a streaming write requires ``sinkId``."""
        url = require(options, "url", "the broker URL, e.g. 'txb://127.0.0.1:5445'")
        queue = require(options, "queue", "the queue (or topic) the rows are sent to")
        if "," in queue:
            raise SparkConnectorError(f"option 'queue' names one destination, not {queue!r}")
        sink_id = _clean(options.get("sinkid"))
        if streaming and sink_id is None:
            raise SparkConnectorError(
                "option 'sinkId' is required for a streaming write: a name that stays the "
                "same across restarts of this query (the broker keys the sink's last "
                "committed batch by it)")
        if sink_id is not None and (len(sink_id.encode()) > MAX_SINK_ID_BYTES
                                    or "\x00" in sink_id):
            raise SparkConnectorError(
                f"option 'sinkId' must be 1 to {MAX_SINK_ID_BYTES} bytes without NUL, "
                f"not {sink_id!r}")
        return cls(url=url, queue=queue, sink_id=sink_id,
                   rows_per_branch=int_option(options, "rowsPerBranch", None))


def _redact(url: str) -> str:
    """The URL without its password (it goes into error messages)."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    userinfo, _, hosts = rest.rpartition("@")
    user = userinfo.partition(":")[0]
    return f"{scheme}://{user}:***@{hosts}"


def open_connection(url: str, *, wait: float = RECONNECT_WAIT, **options: Any) -> Connection:
    """Connect to the broker of option ``url``, trying again for up to ``wait``
    seconds while no broker answers (a restarting broker); refusals name the option."""
    import txbroker

    options.setdefault("timeout", CONNECT_TIMEOUT)
    deadline = time.monotonic() + wait
    try:
        while True:
            try:
                return txbroker.connect(url, **options)
            except ConnectionLost:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(RECONNECT_PAUSE)
    except AuthenticationFailed as exc:
        raise SparkConnectorError(
            f"option 'url': the broker refused the credentials of {_redact(url)} ({exc})"
        ) from exc
    except ConnectionLost as exc:
        raise SparkConnectorError(
            f"option 'url': no broker answered at {_redact(url)} ({exc})") from exc
    except (TxBrokerError, ValueError) as exc:
        raise SparkConnectorError(
            f"option 'url': cannot connect to {_redact(url)}: "
            f"{type(exc).__name__}: {exc}") from exc


def queue_error(option: str, queue: str, exc: BrokerError) -> SparkConnectorError:
    """A broker refusal about one queue, as an error naming the option."""
    if isinstance(exc, NotFound):
        return SparkConnectorError(f"option '{option}': queue {queue!r} does not exist ({exc})")
    return SparkConnectorError(
        f"option '{option}': queue {queue!r}: {type(exc).__name__}: {exc}")


def close_quietly(conn: Connection | None) -> None:
    """Close a connection, ignoring errors (cleanup after a failure)."""
    if conn is None:
        return
    with contextlib.suppress(Exception):  # cleanup must not hide the first error
        conn.close()

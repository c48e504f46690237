"""The rows the connectors produce and accept, as Arrow.

Read side: one ``stream_read`` page (a :class:`StreamChunk` of list columns)
becomes one ``pyarrow.RecordBatch`` of the output schema::

    queue string, seq long, message_id string, key string, body <binary |
    string | struct>, headers map<string,string>, timestamp timestamp,
    redelivered boolean

``key`` is the message header ``key``. The body is raw bytes (``format=binary``),
UTF-8 text (``format=text``) or a JSON object parsed by ``pyarrow.json`` into the
struct given by option ``jsonSchema`` (``format=json``); a body that is not a
JSON object of that shape reads as null. Spark checks the batch's Arrow schema
against ``to_arrow_schema(schema, timezone="UTC")``, so every column is built
with exactly that type.

Write side: the sink accepts ``body`` (binary or string, required) and the
optional ``key`` (string), ``headers`` (map<string,string>) and ``message_id``
(string). :func:`check_sink_schema` runs on the driver before any task, so a
wrong column fails the query before anything is sent.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.json as pa_json  # type: ignore[import-untyped]

from txbroker.spark._common import SEND_CHUNK_BYTES, SEND_CHUNK_MESSAGES, SparkConnectorError

#: The columns before and after ``body``, in DDL (``body`` goes between them).
_HEAD_DDL = "queue string, seq long, message_id string, key string"
_TAIL_DDL = "headers map<string,string>, timestamp timestamp, redelivered boolean"
#: The message header that becomes the ``key`` column.
KEY_HEADER = "key"

#: Columns the sink accepts, with the Spark type names they may have.
SINK_COLUMNS: dict[str, tuple[str, ...]] = {
    "body": ("binary", "string"),
    "key": ("string",),
    "headers": ("map<string,string>",),
    "message_id": ("string",),
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


def source_ddl(body_format: str, json_schema: str | None) -> str:
    """The whole output schema as a DDL string (Spark parses it on the JVM side)."""
    return f"{_HEAD_DDL}, body {body_ddl(body_format, json_schema)}, {_TAIL_DDL}"


# -- read side ---------------------------------------------------------------------


@dataclass
class ChunkColumns:
    """The list columns of one ``stream_read`` page (``StreamChunk``'s shape)."""

    seqs: Sequence[int]
    message_ids: Sequence[str | None]
    headers: Sequence[dict[str, str] | None]
    timestamps: Sequence[int]
    delivery_counts: Sequence[int]
    bodies: Sequence[bytes]


class BatchBuilder:
    """Builds Arrow record batches of the output schema from stream pages.

    ``arrow_schema`` is ``to_arrow_schema(schema, timezone="UTC")`` of the
    schema Spark gave the reader (built by the caller, which imports pyspark).
    """

    def __init__(self, arrow_schema: Any, body_format: str) -> None:
        self.schema = arrow_schema
        self.body_format = body_format
        self.body_type = arrow_schema.field("body").type
        self.headers_type = arrow_schema.field("headers").type
        self.timestamp_type = arrow_schema.field("timestamp").type

    def build(self, queue: str, chunk: Any) -> Any:
        """One ``pyarrow.RecordBatch`` for the messages of ``chunk`` (may be empty)."""
        count = len(chunk.seqs)
        if any(chunk.headers):
            headers_list = [h or {} for h in chunk.headers]
            keys = pa.array([h.get(KEY_HEADER) for h in headers_list], pa.string())
            headers = self._headers(headers_list)
        else:  # no message of the page has headers (the common case): no per-row work
            keys = pa.nulls(count, pa.string())
            headers = pa.MapArray.from_arrays(
                pa.array([0] * (count + 1), pa.int32()), pa.array([], pa.string()),
                pa.array([], pa.string()), type=self.headers_type)
        columns = {
            "queue": pa.repeat(pa.scalar(queue, pa.string()), count),
            "seq": pa.array(chunk.seqs, pa.int64()),
            "message_id": pa.array(chunk.message_ids, pa.string()),
            "key": keys,
            "body": self._bodies(chunk.bodies),
            "headers": headers,
            "timestamp": pa.array(chunk.timestamps, pa.int64())
            .cast(pa.timestamp("ms", tz="UTC"))
            .cast(self.timestamp_type),
            "redelivered": pa.array([n > 0 for n in chunk.delivery_counts], pa.bool_()),
        }
        arrays = [columns[name].cast(self.schema.field(name).type)
                  for name in self.schema.names]
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)

    def _bodies(self, bodies: Sequence[bytes]) -> Any:
        binary = pa.array(bodies, pa.binary())
        if self.body_format == "text":
            try:
                return binary.cast(pa.string())
            except pa.ArrowInvalid:  # not UTF-8: decode row by row, replacing bad bytes
                return pa.array([b.decode("utf-8", "replace") for b in bodies], pa.string())
        if self.body_format == "json":
            return parse_json_bodies(bodies, self.body_type)
        return binary

    def _headers(self, headers_list: list[dict[str, str]]) -> Any:
        offsets = [0]
        keys: list[str] = []
        values: list[str | None] = []
        for headers in headers_list:
            keys.extend(headers)
            values.extend(headers.values())
            offsets.append(len(keys))
        return pa.MapArray.from_arrays(
            pa.array(offsets, pa.int32()), pa.array(keys, pa.string()),
            pa.array([None if v is None else str(v) for v in values], pa.string()),
            type=self.headers_type)


def parse_json_bodies(bodies: Sequence[bytes], struct_type: Any) -> Any:
    """Parse JSON object bodies into a ``StructArray`` of ``struct_type``.

    The whole page is parsed at once as JSON lines; when that fails (a body
    that is not an object of the schema, an empty body) the page is parsed body
    by body and the bad ones become null.
    """
    schema = pa.schema(list(struct_type))
    if not bodies:
        return pa.array([], struct_type)
    joined = b"\n".join(bodies)
    multiline = joined.count(b"\n") != len(bodies) - 1
    try:
        table = _read_json(joined, schema, multiline)
        if table.num_rows == len(bodies):
            return _as_struct(table, struct_type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    parts = []
    for body in bodies:
        try:
            table = _read_json(body, schema, b"\n" in body)
            parts.append(_as_struct(table, struct_type) if table.num_rows == 1
                         else pa.nulls(1, struct_type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            parts.append(pa.nulls(1, struct_type))
    return pa.concat_arrays(parts)


def _read_json(data: bytes, schema: Any, multiline: bool) -> Any:
    parse = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore",
                                 newlines_in_values=multiline)
    return pa_json.read_json(io.BytesIO(data), parse_options=parse,
                             read_options=pa_json.ReadOptions(use_threads=False))


def _as_struct(table: Any, struct_type: Any) -> Any:
    columns = [table.column(i).combine_chunks() for i in range(table.num_columns)]
    return pa.StructArray.from_arrays(columns, fields=list(struct_type))


# -- write side --------------------------------------------------------------------


def check_sink_schema(schema: Any) -> None:
    """Refuse an input schema the sink cannot write, naming the column.

    ``schema`` is the Spark ``StructType`` of the DataFrame being written.
    """
    names = [field.name for field in schema.fields]
    if "body" not in names:
        raise SparkConnectorError(
            f"column 'body' is required (binary or string); the DataFrame has {names}")
    for field in schema.fields:
        allowed = SINK_COLUMNS.get(field.name)
        if allowed is None:
            raise SparkConnectorError(
                f"column {field.name!r} cannot be written to txbroker: the sink takes "
                f"{', '.join(SINK_COLUMNS)} (drop or rename it)")
        type_name = field.dataType.simpleString()
        if type_name not in allowed:
            raise SparkConnectorError(
                f"column {field.name!r} has type {type_name}; it must be "
                f"{' or '.join(allowed)}")


@dataclass
class OutgoingChunk:
    """Messages for one ``send_batch`` call."""

    bodies: list[bytes]
    headers: list[dict[str, str] | None] | None
    message_ids: list[str | None] | None

    def split(self, count: int) -> tuple[OutgoingChunk, OutgoingChunk | None]:
        """The first ``count`` messages, and the rest (None when nothing is left)."""
        if count >= len(self.bodies):
            return self, None

        def cut(values: list[Any] | None, lo: int, hi: int | None) -> list[Any] | None:
            return None if values is None else values[lo:hi]

        head = OutgoingChunk(self.bodies[:count], cut(self.headers, 0, count),
                             cut(self.message_ids, 0, count))
        tail = OutgoingChunk(self.bodies[count:], cut(self.headers, count, None),
                             cut(self.message_ids, count, None))
        return head, tail


def outgoing_chunks(batch: Any) -> Iterator[OutgoingChunk]:
    """Split one input ``RecordBatch`` into ``send_batch`` calls under the size limits."""
    body_column = batch.column(batch.schema.get_field_index("body"))
    if pa.types.is_string(body_column.type) or pa.types.is_large_string(body_column.type):
        body_column = body_column.cast(pa.binary())
    bodies: list[bytes] = body_column.to_pylist()
    headers = _headers_of(batch)
    message_ids = _column(batch, "message_id")
    start = 0
    while start < len(bodies):
        end, size = start, 0
        while end < len(bodies) and end - start < SEND_CHUNK_MESSAGES:
            body = bodies[end]
            if body is None:
                raise SparkConnectorError("column 'body' holds a null: every row needs a body")
            size += len(body) + 64
            if size > SEND_CHUNK_BYTES and end > start:
                break
            end += 1
        yield OutgoingChunk(
            bodies=bodies[start:end],
            headers=None if headers is None else headers[start:end],
            message_ids=None if message_ids is None else message_ids[start:end],
        )
        start = end


def _column(batch: Any, name: str) -> list[Any] | None:
    index = batch.schema.get_field_index(name)
    return None if index < 0 else batch.column(index).to_pylist()


def _headers_of(batch: Any) -> list[dict[str, str] | None] | None:
    """Per-row headers from the ``headers`` map column and the ``key`` column."""
    maps = _column(batch, "headers")
    keys = _column(batch, "key")
    if maps is None and keys is None:
        return None
    rows = batch.num_rows
    result: list[dict[str, str] | None] = []
    for i in range(rows):
        entries = maps[i] if maps is not None else None
        headers = {k: v for k, v in entries if v is not None} if entries else {}
        if keys is not None and keys[i] is not None:
            headers[KEY_HEADER] = keys[i]
        result.append(headers or None)
    return result

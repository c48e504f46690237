"""Named limits and defaults of the broker core (all settable in the config file)."""

from __future__ import annotations

from dataclasses import dataclass

#: 4 MiB: ActiveMQ/Artemis and RabbitMQ users rarely send more on a queue;
#: bigger payloads belong in object storage with a reference in the message.
DEFAULT_MAX_MESSAGE_SIZE = 4 * 1024 * 1024
#: Unacked deliveries one consumer may hold (RabbitMQ caps prefetch at 65535).
DEFAULT_MAX_UNACKED_PER_CONSUMER = 10_000
#: Default prefetch of a subscription (RabbitMQ's STOMP default is unlimited;
#: Artemis' consumer window is ~1 MiB, about 1,000 small messages).
DEFAULT_PREFETCH = 100
#: Staged operations (sends + acks) in one local transaction.
DEFAULT_MAX_TX_OPERATIONS = 10_000
#: Queue and topic names: 1–255 characters (AMQP 0-9-1 short string).
MAX_NAME_LENGTH = 255
#: How often ready messages with a TTL are scanned for expiry (Artemis: 30 s).
DEFAULT_EXPIRY_SCAN_MS = 1_000
#: Messages (sent + consumed) one XA branch may track (seed 002: "at most 256").
DEFAULT_MAX_XA_BRANCH_MESSAGES = 256
#: Messages one Spark sink branch (format id ``xid.SINK_FORMAT_ID``) may track: a task
#: writes its partition of a micro-batch in branches of up to this many messages (a
#: prepared branch is one journal entry, which holds at most 65,535 bodies).
DEFAULT_MAX_SINK_BRANCH_MESSAGES = 50_000
#: Messages one ``stream_read`` returns at most, and about how many bytes.
DEFAULT_MAX_STREAM_READ = 50_000
DEFAULT_MAX_STREAM_READ_BYTES = 4 * 1024 * 1024
#: XA transaction timeout (seed 002: 180 s by default; set_transaction_timeout(0)
#: restores it). Seed 002 makes it an *idle* timeout: an ended branch (IDLE, and
#: rollback-only or suspended) not prepared, committed or rolled back within it is
#: rolled back; an ACTIVE branch has no timeout while its session is open.
DEFAULT_XA_TRANSACTION_TIMEOUT_MS = 180_000
#: A branch whose session broke may be reattached within this time (seed 002: 3 minutes).
DEFAULT_XA_REATTACH_MS = 180_000


@dataclass(frozen=True, slots=True)
class Limits:
    """The core's limits. Requests beyond them get a clear BrokerError."""

    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    max_unacked_per_consumer: int = DEFAULT_MAX_UNACKED_PER_CONSUMER
    default_prefetch: int = DEFAULT_PREFETCH
    max_tx_operations: int = DEFAULT_MAX_TX_OPERATIONS
    expiry_scan_ms: int = DEFAULT_EXPIRY_SCAN_MS
    max_xa_branch_messages: int = DEFAULT_MAX_XA_BRANCH_MESSAGES
    max_sink_branch_messages: int = DEFAULT_MAX_SINK_BRANCH_MESSAGES
    max_stream_read: int = DEFAULT_MAX_STREAM_READ
    max_stream_read_bytes: int = DEFAULT_MAX_STREAM_READ_BYTES
    xa_transaction_timeout_ms: int = DEFAULT_XA_TRANSACTION_TIMEOUT_MS
    xa_reattach_ms: int = DEFAULT_XA_REATTACH_MS
    auto_create: bool = True  #: sending or subscribing to an unknown name creates a queue

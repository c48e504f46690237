"""The protocol edges: each turns one protocol's frames into calls on the operation
layer's :class:`~txbroker.server.ops.Session` and the outcomes back into frames, and
decides nothing about a request itself.

* ``native/`` — txbroker's own protocol (the client libraries, the router);
* ``stomp/`` — STOMP 1.0–1.2;
* ``amqp/`` — AMQP 0-9-1 (pika, aio-pika, kombu, Celery);
* ``http/`` — the REST API, Prometheus metrics and the web console.
"""

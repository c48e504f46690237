"""The transaction router (seed 000), one part of the broker core: every module of it
lives here (``docs/router.md``, ``docs/architecture.md``). Edges reach it only through
the :class:`~txbroker.core.broker.Broker` front."""

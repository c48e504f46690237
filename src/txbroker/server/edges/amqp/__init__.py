"""The AMQP 0-9-1 edge (docs/amqp.md): the connection and its handshake
(``connection.py``, ``handshake.py``), each channel's methods (``channel.py``,
``declares.py``), exchanges and bindings (``model.py``), their durable state
(``state.py``), dead letters (``deadletters.py``) and message properties
(``content.py``)."""

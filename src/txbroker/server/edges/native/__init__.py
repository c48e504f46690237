"""The native protocol's edge: the asyncio connection (``connection.py``), its handler
table (``handlers.py``), the argument checks (``args.py``), and the handlers of the
stream (``stream_handlers.py``) and router (``router_handlers.py``) operations."""

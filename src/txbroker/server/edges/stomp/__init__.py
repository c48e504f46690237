"""The STOMP edge: the asyncio connection (``connection.py``) and the frame handlers
over the operation layer (``frames.py``, compiled with mypyc)."""

"""The broker server: the asyncio edge around the pure core.

``app.py`` runs the store, the listeners and the effects; ``ops.py`` is the
operation layer every protocol edge calls (``connection.py`` for the native
protocol, ``stomp.py`` + ``stomp_frames.py`` for STOMP); ``seams.py`` holds the
protocol types between them.
"""

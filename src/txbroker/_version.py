"""The package version, in a module of its own: the server announces it (STOMP
``CONNECTED``) without importing the package's client-facing ``__init__``."""

__version__ = "0.1.0"

"""Checks of the native protocol's request arguments (docs/protocol.md).

Each returns the argument or raises ``BadRequest`` (``XAError(XAER_INVAL)``
for the XA ones) naming the field and the type it must have.
"""

from __future__ import annotations

from typing import Any, Final

from txbroker.errors import XAER_INVAL, BadRequest, XAError

#: Marks an argument without a default: it must be given.
REQUIRED: Final[Any] = ...

#: Queue settings a request may give at its top level or in ``settings``.
SETTING_KEYS: Final = frozenset(
    ["max_messages", "max_bytes", "max_deliveries", "dead_letter_queue", "expiry_queue",
     "default_ttl_ms", "redelivery_delay_ms", "ingress", "egress", "dup_window",
     "reject_to_sender_on_discard", "overflow", "overflow_queue"]
)


def arg(args: dict[str, Any], name: str, kind: type | tuple[type, ...],
        default: Any = REQUIRED) -> Any:
    """``args[name]`` if it is a ``kind`` (never a bool for ``int``); ``default``
    when absent; a ``None`` default also accepts an explicit nil."""
    value = args.get(name, default)
    if value is REQUIRED:
        raise BadRequest(f"missing argument {name!r}")
    if value is None and default is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise BadRequest(f"argument {name!r} must be of type {names}")
    return value


def int_arg(args: dict[str, Any], name: str, default: Any = REQUIRED) -> Any:
    """An integer argument (not a bool)."""
    value = arg(args, name, int, default)
    if isinstance(value, bool):
        raise BadRequest(f"argument {name!r} must be an integer")
    return value


def headers_arg(args: dict[str, Any]) -> dict[str, str] | None:
    """``headers``: a map of strings to strings, or absent."""
    headers = args.get("headers")
    if headers is None:
        return None
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise BadRequest("argument 'headers' must be a map of strings to strings")
    return headers


def tags_arg(args: dict[str, Any]) -> list[int]:
    """``tags``: a non-empty list (the operation layer checks each tag)."""
    tags: list[int] = arg(args, "tags", list)
    if not tags:
        raise BadRequest("argument 'tags' must list at least one delivery tag")
    return tags


def settings_arg(args: dict[str, Any]) -> dict[str, Any]:
    """Queue settings, from ``settings`` and the top-level setting keys."""
    nested = args.get("settings")
    if nested is not None and not isinstance(nested, dict):
        raise BadRequest("argument 'settings' must be a map")
    found = dict(nested or {})
    found.update({k: v for k, v in args.items() if k in SETTING_KEYS})
    return found


def list_arg(args: dict[str, Any], name: str, kind: type, length: int) -> Any:
    """A list as long as ``bodies`` of ``kind`` values or nil (absent: None)."""
    values = args.get(name)
    if values is None:
        return None
    if not isinstance(values, list) or len(values) != length:
        raise BadRequest(f"argument {name!r} must be a list as long as 'bodies'")
    for value in values:
        if value is not None and not isinstance(value, kind):
            raise BadRequest(f"argument {name!r} must hold {kind.__name__} values or nil")
    if kind is dict:
        for value in values:
            if value is not None and not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in value.items()):
                raise BadRequest(f"argument {name!r} must hold maps of strings to strings")
    return values


def xid_arg(args: dict[str, Any]) -> str:
    """``xid`` in its text form."""
    xid = args.get("xid")
    if type(xid) is not str:
        raise XAError(XAER_INVAL, "argument 'xid' must be the Xid's text form "
                                  "(FORMATID-GTRIDHEX-BQUALHEX)")
    return xid


def flags_arg(args: dict[str, Any], default: int) -> int:
    """XA ``flags`` (an integer)."""
    flags = args.get("flags", default)
    if type(flags) is not int:
        raise XAError(XAER_INVAL, "argument 'flags' must be an integer")
    return flags

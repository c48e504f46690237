"""The public surface, guarded (as trio's ``test_exports.py`` does).

* Each public package exports exactly the names listed here: removing or
  adding a public name is a decision made in this file, not by accident.
* Every exported name resolves, and every public module, class, function
  and method under ``txbroker`` has a docstring.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
from types import ModuleType

import pytest

import txbroker
from txbroker import _build

#: The transaction router's client API (docs/router.md), the same in both flavours.
ROUTER = {"ALL_ROUTER_EVENTS", "ALL_USER_EVENTS", "CLIENT_PLAN", "ClientMessageHandler",
          "ClientState", "EXCEPTION", "EventRanges", "REASON_PREEMPTED",
          "Key", "MessageType", "PARTITION_DOWN", "PARTITION_UP", "PLAN", "PRIMARY",
          "PartitionMap", "REASON_CLIENT", "REASON_LOST", "REASON_SRVDIED", "REASON_TIMEOUT",
          "REASON_UNKNOWN", "ROUTER_EVENT_MAX", "ROUTER_EVENT_MIN", "Role", "RouterMessage",
          "SECONDARY", "SERVER_DOWN", "SERVER_UP", "ServerMessageHandler", "ServerState",
          "ServerTransactionController", "TransactionController", "USER_EVENT_MAX",
          "USER_EVENT_MIN", "event_ranges"}

PUBLIC: dict[str, set[str]] = {
    "txbroker": {"BrokerError", "Connection", "ConnectionLost", "ErrorCode", "IllegalState",
                 "TransactionInDoubt", "TransactionRolledBack", "TxBrokerError", "XAError",
                 "Xid", "__version__", "aio", "connect"},
    "txbroker.aio": {"AsyncConnection", "AsyncMessage", "AsyncSubscription",
                     "AsyncTransaction", "Connection", "Message", "Subscription", "Transaction",
                     "connect", "open_connection"},
    "txbroker.core": {"Broker", "LATER", "Limits"},
    "txbroker.client": {"AsyncConnection", "AsyncMessage", "AsyncSubscription",
                        "AsyncTransaction", "ClientURL", "ConnectOptions", "Connection",
                        "HostPort", "Message", "Stream", "Subscription", "TCPTransport",
                        "Transaction", "Transport", "connect", "parse_url"},
    "txbroker.tm": {"BrokerParticipant", "BrokerResource", "DecisionLog", "GlobalTransaction",
                    "Participant", "PostgresParticipant", "PostgresResource", "RecoveryReport",
                    "InDoubt", "Resource", "RolledBack", "STEPS", "TMError", "TM_FORMAT_ID",
                    "TransactionManager", "branch_xid", "recover"},
    "txbroker.spark": {"register"},
    "txbroker.sim": {"PLANTS", "SCENARIOS", "Plant", "SeedResult", "World", "run_seed",
                     "run_seeds"},
    "txbroker.router": ROUTER,
    "txbroker.router.aio": ROUTER | {"AsyncClientMessageHandler", "AsyncServerMessageHandler",
                                     "AsyncServerTransactionController",
                                     "AsyncTransactionController"},
    "txbroker.protocol": {"DEFAULT_MAX_FRAME_SIZE", "Err", "Event", "LocalProtocolError",
                          "NEED_DATA", "NativeConnection", "Ok", "Push", "Request", "Role",
                          "encode_error"},
    "txbroker.protocol.amqp": {"DEFAULT_FRAME_MAX", "DEFAULT_MAX_BODY_SIZE", "FRAME_END",
                               "FRAME_MIN_SIZE", "PROTOCOL_HEADER", "TRANSITIONS",
                               "AmqpConnection", "AmqpProtocolError", "CodecState",
                               "ContentReceived", "Event", "HeartbeatReceived",
                               "MethodReceived", "ProtocolHeaderMismatch",
                               "ProtocolHeaderReceived", "ReplyCode"},
}


def all_modules() -> list[ModuleType]:
    """Every module of the package (the Spark ones too: ``make test`` installs pyspark)."""
    found = [txbroker]
    for info in pkgutil.walk_packages(txbroker.__path__, "txbroker."):
        found.append(importlib.import_module(info.name))
    return found


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_package_exports_exactly_these_names(name: str) -> None:
    module = importlib.import_module(name)
    assert set(module.__all__) == PUBLIC[name]
    for export in module.__all__:
        assert getattr(module, export) is not None, f"{name}.{export} does not resolve"


def test_every_module_declares_what_it_exports_or_nothing_public() -> None:
    for module in all_modules():
        for export in getattr(module, "__all__", []):
            assert hasattr(module, export), f"{module.__name__}.__all__ names {export!r}"


def _undocumented(module: ModuleType) -> list[str]:
    missing = [] if module.__doc__ else [module.__name__]
    for attr, obj in vars(module).items():
        if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj) and not obj.__doc__:
            missing.append(f"{module.__name__}.{attr}")
        if not inspect.isclass(obj):
            continue
        if obj.__doc__ is None:
            missing.append(f"{module.__name__}.{attr}")
        for name, member in vars(obj).items():
            if name.startswith("_"):
                continue
            function = member.fget if isinstance(member, property) else member
            if isinstance(function, staticmethod | classmethod):
                function = function.__func__
            if inspect.isfunction(function) and not function.__doc__:
                missing.append(f"{module.__name__}.{attr}.{name}")
    return missing


def test_every_public_name_has_a_docstring() -> None:
    if _build.MODE == "compiled":
        # mypyc keeps no module docstrings: check the sources, in a pure interpreter
        env = dict(os.environ, **{_build.PURE_ENV: "1"})
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               f"{__file__}::test_every_public_name_has_a_docstring"],
                              env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-3000:]
        return
    missing = [name for module in all_modules() for name in _undocumented(module)]
    assert missing == []

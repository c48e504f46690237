"""A deterministic asyncio event loop: one thread, virtual time, an in-memory network.

Theory of operation
-------------------
The simulator's first slice drives the pure core directly (``node.py``). The code
around it — the asyncio edges, the operation layer, HA, the client libraries — runs
on an event loop. :class:`SimLoop` is an event loop of our own on which that code
runs unchanged, and deterministically:

- **Virtual time.** ``loop.time()`` is a number the loop advances itself: when no
  callback is ready, the clock jumps to the next scheduled one (``asyncio.sleep``,
  ``call_later``, ``asyncio.timeout``, heartbeats and lease timers all run on it). An
  hour of timers takes no wall time. Nothing is ready and nothing is scheduled while
  :meth:`run_until_complete` still waits: the system is stuck, and the loop says so
  (:class:`SimulationStalled`) instead of blocking forever.
- **No threads.** ``call_soon_threadsafe`` is ``call_soon``; ``run_in_executor`` runs
  the function at once, inline (its future is already done), so code that hands
  work to a thread stays on the one thread, in a fixed order.
- **No real I/O.** ``create_connection`` and ``create_server`` (so also
  ``asyncio.open_connection`` and ``start_server``) go to the loop's
  :class:`~txbroker.sim.memnet.SimNetwork`: listeners by (host, port), connections
  as pairs of in-memory transports whose bytes arrive after virtual delays drawn
  from the simulation's random source. Sockets, readers/writers on file
  descriptors, subprocesses, signals, DNS and TLS raise :class:`SimulationError`.

- **Processes.** :meth:`SimLoop.spawn` starts a simulated process, :meth:`SimLoop.kill`
  ends it as ``kill -9`` does, :meth:`SimLoop.pause` and :meth:`SimLoop.resume` stop
  and continue it as ``SIGSTOP`` and ``SIGCONT`` do (its callbacks are held meanwhile).
- **Bounded runs.** The loop counts its steps (turns). A run past :data:`MAX_STEPS`
  steps is stuck (an actor retrying for ever, virtual time going on): the loop
  raises :class:`SimulationStuck`, which the runner reports as the seed's
  violation. While a run keeps the cyclic garbage collector off (the replicated
  scenarios), the loop collects every :data:`COLLECT_EVERY_STEPS` steps — at a step
  count, never at a moment of wall time, so a seed still replays exactly — and the
  garbage of a long run stays bounded.

Each callback runs in the order asyncio's own scheduler gives (FIFO for ready
callbacks; by due time, then by scheduling order, for timers), so one seed and the
same program give the same run — as long as the program itself does not iterate
over a set of objects hashed by identity when the order matters (the trace hash of
a run, compared between two runs, is what catches that).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import gc
import heapq
import random
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, TypeVarTuple, Unpack

from txbroker.sim.memnet import HOST, PROCESS, SimNetwork

__all__ = ["SimLoop", "SimulationError", "SimulationStalled", "SimulationStuck"]

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")


class SimulationError(RuntimeError):
    """Code under simulation asked for something the simulation does not give (a real
    socket, a thread, a subprocess, TLS)."""


class SimulationStalled(SimulationError):
    """Nothing is ready and nothing is scheduled, yet the awaited work is not done:
    every task waits for something that will never happen."""


class SimulationStuck(SimulationError):
    """The run went past its cap of steps (:data:`MAX_STEPS`) and is not over: it would
    go on for ever (its message says ``stuck: N steps / T virtual seconds``)."""


#: Steps (turns) of the loop after which a run is stuck: an actor that retries for ever
#: takes steps as its virtual time goes on, a run that only sleeps takes few. A normal
#: seed of the live scenarios takes 7,000-31,000 steps (seeds 0-4 of each, measured:
#: ``bench/sim_traces.py``), so this is more than 15 times the longest seen.
MAX_STEPS = 500_000
#: Steps a stuck run's shutdown may take (the cancellation of what is left) before it
#: is stuck too.
CLEANUP_STEPS = 200_000
#: Steps between two full collections of cyclic garbage while the collector is off:
#: three times the longest normal run measured, so a normal run is never collected
#: inside (its trace stays what it was); a stuck one is, five times before its cap.
COLLECT_EVERY_STEPS = 100_000

#: Turns of the loop in a row at one instant of virtual time after which a run is
#: stuck in a busy loop (real time would have moved; virtual time moves only when
#: nothing is ready): far more than any burst of work at one instant needs.
MAX_TURNS_AT_ONE_INSTANT = 100_000


class _Clock:
    """The loop's "selector": waiting for ``timeout`` seconds advances the clock."""

    def __init__(self, loop: SimLoop) -> None:
        self._loop = loop

    def select(self, timeout: float | None) -> list[Any]:
        if timeout is None:
            raise SimulationStalled(
                f"at virtual time {self._loop.time():.6f} s nothing is ready and nothing "
                "is scheduled, but the simulation is still waiting")
        if timeout > 0:
            self._loop._advance(timeout)
        return []

    def close(self) -> None:
        pass


class SimLoop(asyncio.BaseEventLoop):
    """An asyncio event loop with virtual time and an in-memory network (see the
    module docstring). ``seed`` seeds :attr:`random`, the one random source of the
    simulation (the network's delays come from it); ``start`` is the clock's first
    value, in seconds."""

    def __init__(self, seed: int, *, start: float = 0.0,
                 max_steps: int | None = None) -> None:
        super().__init__()
        self._now = float(start)
        #: turns of the loop so far
        self.steps = 0
        #: the steps past which the run is stuck (:class:`SimulationStuck`; ``None``:
        #: :data:`MAX_STEPS`, read when the loop is made)
        self.max_steps = MAX_STEPS if max_steps is None else max_steps
        #: called once a run is found stuck, before the loop shuts down what is left
        #: (a scenario notes where its trace ends: the shutdown is not part of the run)
        self.on_stuck: Callable[[], object] | None = None
        self._selector = _Clock(self)
        #: the simulation's one random source
        self.random = random.Random(seed)
        #: listeners and connections (``memnet.py``)
        self.network = SimNetwork(self)
        #: virtual seconds the clock jumped over (no callback was ready)
        self.idle = 0.0
        #: simulated processes that died: none of their callbacks runs again
        self.dead: set[int] = set()
        #: simulated processes stopped (SIGSTOP): their callbacks wait in ``_held``
        self.paused: set[int] = set()
        self._held: list[asyncio.Handle] = []
        self._turns_at_now = 0
        self._next_process = 1
        #: the process each task belongs to (where it was created); strong references,
        #: so that a dead process's tasks stay (pending, never run) until the loop closes
        #: instead of being collected at a moment that depends on the garbage collector
        self._process_of: dict[asyncio.Future[Any], int] = {}
        self.set_task_factory(self._new_task)
        #: what reached the loop's exception handler (an exception no code handled),
        #: but the pending tasks of dead processes being collected
        self.errors: list[str] = []

    # -- time ----------------------------------------------------------------------

    def time(self) -> float:
        """The virtual clock, in seconds."""
        return self._now

    def _advance(self, seconds: float) -> None:
        self._now += seconds
        self.idle += seconds

    # -- what BaseEventLoop asks of a concrete loop ------------------------------

    def _run_once(self) -> None:
        """One turn of the loop; a busy loop (the clock never moves) is stopped with
        :class:`SimulationStalled`, a run past its caps with :class:`SimulationStuck`,
        instead of running for ever."""
        before = self._now
        super()._run_once()  # type: ignore[misc]
        self.steps += 1
        if self.steps % COLLECT_EVERY_STEPS == 0 and not gc.isenabled():
            gc.collect()  # at a step count: the same step in every run of the seed
        if self.steps > self.max_steps:
            if self.on_stuck is not None:
                self.on_stuck()
            raise SimulationStuck(f"stuck: {self.steps} steps / {self._now:.3f} virtual "
                                  "seconds, and the run is not over")
        self._turns_at_now = self._turns_at_now + 1 if self._now == before else 0
        if self._turns_at_now > MAX_TURNS_AT_ONE_INSTANT:
            raise SimulationStalled(
                f"at virtual time {self._now:.6f} s the loop turned "
                f"{MAX_TURNS_AT_ONE_INSTANT} times without the clock moving: a busy loop")

    def _process_events(self, event_list: list[Any]) -> None:
        pass  # no file descriptors: the network schedules its callbacks itself

    def _write_to_self(self) -> None:
        pass  # one thread: nothing ever needs waking

    # -- one thread ----------------------------------------------------------------

    def call_soon_threadsafe(self, callback: Callable[[Unpack[_Ts]], object],
                             *args: *_Ts,
                             context: contextvars.Context | None = None) -> asyncio.Handle:
        """There are no other threads: the same as ``call_soon``."""
        return self.call_soon(callback, *args, context=context)

    def run_in_executor(self, executor: concurrent.futures.Executor | None,
                        func: Callable[[Unpack[_Ts]], _T], *args: *_Ts
                        ) -> asyncio.Future[_T]:
        """Run ``func`` now, on this thread; return its (done) future."""
        future: asyncio.Future[_T] = self.create_future()
        try:
            future.set_result(func(*args))
        except BaseException as exc:  # handed to the awaiting code
            future.set_exception(exc)
        return future

    def set_default_executor(self, executor: Any) -> None:
        """Refused: executor work runs inline here."""
        raise SimulationError("a SimLoop runs executor work inline: no executor to set")

    # -- processes -----------------------------------------------------------------

    def spawn(self, host: str, main: Coroutine[Any, Any, _T]) -> tuple[int, asyncio.Task[_T]]:
        """Start a simulated process on ``host``: ``main`` runs in a context of its own
        (:data:`~txbroker.sim.memnet.PROCESS`, :data:`~txbroker.sim.memnet.HOST`), and
        so does every task and callback it starts. Returns its number and main task."""
        process = self._next_process
        self._next_process += 1
        context = contextvars.copy_context()
        context.run(HOST.set, host)
        context.run(PROCESS.set, process)
        return process, self.create_task(main, context=context)

    def kill(self, process: int) -> None:
        """The process dies as under ``kill -9``: none of its callbacks runs again (no
        ``finally`` block, no cleanup), its connections are reset after what was on
        its way, and its listeners go."""
        self.dead.add(process)
        self.paused.discard(process)
        for handle in [*self._ready_queue, *self._timers, *self._held]:
            self._bury(handle)
        self._held = [handle for handle in self._held if not handle.cancelled()]
        self.network.crash(process)

    def pause(self, process: int) -> None:
        """The process stops as under ``SIGSTOP``: none of its callbacks runs until
        :meth:`resume` — what falls due meanwhile (its timers, bytes reaching its
        connections, futures it awaits) waits. It keeps everything it holds (its
        connections, listeners, the store's lock); others see a silent peer."""
        self.paused.add(process)
        ready = list(self._ready_queue)
        self._ready_queue.clear()
        for handle in ready:
            self._hold_or(handle, self._ready_queue.append)
        scheduled = self._timers
        timers, scheduled[:] = list(scheduled), []
        for timer in timers:
            self._hold_or(timer, scheduled.append)
        heapq.heapify(scheduled)

    def resume(self, process: int) -> None:
        """The process continues (``SIGCONT``): what it missed runs, in the order it
        came (timers that fell due while it was stopped, at once)."""
        self.paused.discard(process)
        held, self._held = self._held, []
        for handle in held:
            if handle.cancelled():
                continue
            if self._owner(handle) in self.paused:
                self._held.append(handle)
            elif isinstance(handle, asyncio.TimerHandle):
                heapq.heappush(self._timers, handle)
            else:
                self._ready_queue.append(handle)

    @property
    def _ready_queue(self) -> collections.deque[asyncio.Handle]:
        """BaseEventLoop's queue of ready callbacks."""
        ready: collections.deque[asyncio.Handle] = self._ready  # type: ignore[attr-defined]
        return ready

    @property
    def _timers(self) -> list[asyncio.TimerHandle]:
        """BaseEventLoop's heap of timers."""
        timers: list[asyncio.TimerHandle] = self._scheduled  # type: ignore[attr-defined]
        return timers

    @staticmethod
    def _owner(handle: asyncio.Handle) -> int:
        context: contextvars.Context | None = getattr(handle, "_context", None)
        return 0 if context is None else context.get(PROCESS, 0)

    def _hold_or(self, handle: asyncio.Handle, keep: Callable[[Any], object]) -> None:
        """Hold ``handle`` if its process is paused, else ``keep`` it."""
        if self._owner(handle) in self.paused:
            self._held.append(handle)
        else:
            keep(handle)

    def _new_task(self, loop: asyncio.AbstractEventLoop, coro: Any,
                  context: contextvars.Context | None = None) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, context=context)
        self._process_of[task] = (PROCESS.get() if context is None
                                  else context.get(PROCESS, 0))
        return task

    def process_of(self, task: asyncio.Future[Any]) -> int:
        """The simulated process ``task`` belongs to (0: the simulation itself)."""
        return self._process_of.get(task, 0)

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        """Keep what no code handled in :attr:`errors` (the run's checkers judge it);
        a dead process's task collected while pending is no news."""
        task = context.get("task")
        if task is not None and self.process_of(task) in self.dead:
            return
        exception = context.get("exception")
        where = f" ({task!r})" if task is not None else ""
        self.errors.append(f"{context.get('message')}{where}"
                           + (f": {exception!r}" if exception else ""))

    async def _close_the_dead(self) -> None:
        """The coroutines of dead processes' tasks are closed now, while the loop runs
        (what they schedule is buried), rather than by the garbage collector later,
        after the loop is gone, at a moment nobody chose."""
        for task, process in list(self._process_of.items()):
            if process in self.dead and not task.done():
                with contextlib.suppress(BaseException):
                    task.get_coro().close()  # type: ignore[attr-defined]

    def _bury(self, handle: asyncio.Handle) -> None:
        if self._owner(handle) in self.dead:
            handle.cancel()

    def call_soon(self, callback: Callable[[Unpack[_Ts]], object], *args: *_Ts,
                  context: contextvars.Context | None = None) -> asyncio.Handle:
        """``call_soon``; never for a dead process, later for a paused one."""
        handle = super().call_soon(callback, *args, context=context)
        if self.dead:
            self._bury(handle)
        if self.paused and self._owner(handle) in self.paused:
            self._held.append(self._ready_queue.pop())  # (just added)
        return handle

    def call_at(self, when: float, callback: Callable[[Unpack[_Ts]], object], *args: *_Ts,
                context: contextvars.Context | None = None) -> asyncio.TimerHandle:
        """``call_at`` (and ``call_later``); never for a dead process, later for a
        paused one."""
        handle = super().call_at(when, callback, *args, context=context)
        if self.dead:
            self._bury(handle)
        if self.paused and self._owner(handle) in self.paused:
            scheduled = self._timers
            del scheduled[next(n for n, timer in enumerate(scheduled) if timer is handle)]
            heapq.heapify(scheduled)
            self._held.append(handle)
        return handle

    # -- the network ---------------------------------------------------------------

    async def create_connection(  # type: ignore[override]
            self, protocol_factory: Callable[[], asyncio.BaseProtocol],
            host: str | None = None, port: int | None = None, *, ssl: Any = None,
            local_addr: tuple[str, int] | None = None, **_: Any
    ) -> tuple[asyncio.Transport, asyncio.BaseProtocol]:
        """A connection over the simulated network (``asyncio.open_connection`` too)."""
        if ssl:
            raise SimulationError("TLS is not simulated")
        if host is None or port is None:
            raise SimulationError("create_connection needs a host and a port")
        return await self.network.connect(protocol_factory, host, port,
                                          local_host=None if local_addr is None
                                          else local_addr[0])

    async def create_server(
            self, protocol_factory: Callable[[], asyncio.BaseProtocol],
            host: Any = None, port: int | None = None, *, ssl: Any = None, **_: Any
    ) -> Any:
        """A listener on the simulated network (``asyncio.start_server`` too)."""
        if ssl:
            raise SimulationError("TLS is not simulated")
        if not isinstance(host, str):
            raise SimulationError("a simulated listener needs one host name")
        return self.network.listen(protocol_factory, host, port or 0)

    # -- running -------------------------------------------------------------------

    def run(self, main: Any) -> Any:
        """Run coroutine ``main`` to completion as ``asyncio.run`` would (the loop
        current on this thread meanwhile), then cancel what is left and close."""
        asyncio.set_event_loop(self)
        try:
            return self.run_until_complete(main)
        finally:
            # the shutdown may take its steps (a stuck run's too), though not for ever
            self.max_steps = self.steps + CLEANUP_STEPS
            for process in sorted(self.paused):  # continued, so that they can be cancelled
                self.resume(process)
            try:
                _cancel_all(self)
                self.run_until_complete(self._close_the_dead())
                self.run_until_complete(self.shutdown_asyncgens())
            finally:
                asyncio.set_event_loop(None)
                self.close()
                self.dead.update(self._process_of.values())  # collected now: no news
                self._process_of.clear()


#: The loop's methods that would do real I/O (or start a thread or a process): each
#: raises :class:`SimulationError` on a SimLoop.
REFUSED: tuple[str, ...] = (
    "add_reader", "add_writer", "remove_reader", "remove_writer", "add_signal_handler",
    "getaddrinfo", "getnameinfo", "create_datagram_endpoint", "create_unix_connection",
    "create_unix_server", "subprocess_exec", "subprocess_shell", "sock_connect",
    "sock_accept", "sock_recv", "sock_recv_into", "sock_sendall", "sock_sendfile",
    "sendfile", "connect_read_pipe", "connect_write_pipe", "connect_accepted_socket",
    "start_tls")


def _refuser(name: str) -> Callable[..., Any]:
    def refused(self: SimLoop, *args: Any, **kwargs: Any) -> Any:
        raise SimulationError(f"{name} is real I/O: not available in the simulation")

    refused.__name__ = name
    refused.__doc__ = f"Refused: ``{name}`` would be real I/O (:class:`SimulationError`)."
    return refused


for _name in REFUSED:
    setattr(SimLoop, _name, _refuser(_name))


def _cancel_all(loop: SimLoop) -> None:
    # in the order they were made (all_tasks is a set: its order changes from run to run,
    # and what the cancelled tasks log would too)
    tasks = [task for task, process in loop._process_of.items()
             if not task.done() and process not in loop.dead]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

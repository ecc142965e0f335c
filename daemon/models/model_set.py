"""The models one daemon serves by name: loaded on first use, unloaded when idle.

Why a set with an owner: a daemon under systemd serves every local tool, and those want
different models. Each model lives on its own compute thread with its own scheduler,
so one model's load or decoding never waits for another's. :meth:`ModelSet.run` owns
every task (the schedulers, the loads, the expiry of idle models): a request that
leaves while its model loads does not cancel the load, and nothing outlives the set.

A request holds its model from preparation to its end (:meth:`ModelSet.acquire`,
:meth:`ModelSet.release`); a model with a holder is never unloaded. Which idle model
makes room for another is :mod:`meshd.policy.residency`'s choice. A model's counters
outlive its unloads, so ``/metrics`` never goes backwards.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import enum
import gc
import os
import time
from collections.abc import Callable, Iterator
from typing import Final

import anyio
import anyio.abc
import attrs

from meshd.daemon.models.compute import ComputeThread
from meshd.daemon.models.mapping import file_info, model_info
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.models.scheduler import Scheduler
from meshd.daemon.models.statistics import RuntimeFigures, SchedulerCounters, SchedulerStatistics
from meshd.native.default_model import default_model_path
from meshd.native.errors import NativeError
from meshd.native.model import describe_model
from meshd.policy.residency import Resident, expires_at, room_for
from meshd.protocol import ModelInfo

__all__ = ["DEFAULT_KEEP_ALIVE_S", "ModelPlan", "ModelSet", "ModelState", "NoRoom",
           "NoSuchModel", "ServedModel"]

DEFAULT_KEEP_ALIVE_S: Final = 300.0
"""How long an idle model stays loaded when nothing says otherwise (Ollama's 5 minutes)."""

Loader = Callable[["ModelPlan"], ModelRuntime]
"""Loads a model (on its compute thread; blocking)."""


class ModelState(enum.StrEnum):
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"
    UNLOADED = "unloaded"


class NoSuchModel(LookupError):
    """No model of that name is configured."""


class NoRoom(Exception):
    """The model cannot load now: the memory it needs is held by busy models, and the
    requests already waiting for it reach the queue's limit."""


class LoadFailed(Exception):
    """The model's load failed (the message is its error)."""


@attrs.frozen
class ModelPlan:
    """A configured model: what loading it means."""

    name: str
    config: RuntimeConfig
    keep_alive_s: float | None = None
    """Its own keep-alive (negative: forever); None: the set's default."""
    size_bytes: int = 0
    """Its file's size: what it counts against the memory limit."""
    aliases: tuple[str, ...] = ()
    """Other names requests may give it."""
    tags: tuple[str, ...] = ()
    """Labels listings show with it."""


def _renamed_only(new: ModelPlan, old: ModelPlan) -> bool:
    return new != old and attrs.evolve(new, aliases=old.aliases, tags=old.tags) == old


class ServedModel:
    """One configured model and, while loaded, its compute thread, runtime, scheduler."""

    def __init__(self, plan: ModelPlan, *, owned: bool = True) -> None:
        self.plan = plan
        self.name = plan.name
        #: Whether the set loads and unloads it (False: a runtime its caller owns).
        self.owned = owned
        self.state = ModelState.UNLOADED
        self.compute: ComputeThread | None = None
        self.runtime: ModelRuntime | None = None
        self.scheduler: Scheduler | None = None
        self.counters = SchedulerCounters()
        #: Requests holding it (preparing, waiting for its load, or running).
        self.users = 0
        self.last_used = time.monotonic()
        #: When it unloads if still idle (None: never).
        self.expires: float | None = None
        #: The keep-alive its last request asked for (None: its own, else the default).
        self.keep_alive_s: float | None = None
        self.error: str | None = None
        """Why its last load failed."""
        #: What it was when last loaded (None: never loaded).
        self.info: ModelInfo | None = None
        self.waiting_for_room = False
        #: ``unload`` was asked while requests ran: it goes when the last one ends.
        self.unload_asked = False
        #: Its new configuration (SIGHUP), taken once it is unloaded.
        self.pending_plan: ModelPlan | None = None
        self._changed = anyio.Event()
        self._scope: anyio.CancelScope | None = None
        self._stopped = anyio.Event()

    def _set(self, state: ModelState) -> None:
        self.state = state
        self._changed.set()
        self._changed = anyio.Event()

    def statistics(self) -> SchedulerStatistics:
        """Its scheduler's figures; an unloaded model's counters (nothing active)."""
        if self.scheduler is not None:
            return self.scheduler.statistics()
        return SchedulerStatistics.of(self.counters, active=0, queued=0,
                                      runtime=RuntimeFigures())


class ModelSet:
    """Every configured model by name; the first is the default."""

    def __init__(self, plans: list[ModelPlan], load: Loader, *,
                 keep_alive_s: float = DEFAULT_KEEP_ALIVE_S, max_loaded: int | None = None,
                 memory_limit: int | None = None, max_queue: int = 64,
                 step_budget_s: float = 0.05, events: Callable[..., None] | None = None,
                 ) -> None:
        if not plans:
            raise ValueError("a daemon serves at least one model")
        self._load = load
        self.models = {p.name: ServedModel(p) for p in plans}
        self.default = self.models[plans[0].name]
        self.keep_alive_s = keep_alive_s
        self.max_loaded = max_loaded
        self.memory_limit = memory_limit
        self.max_queue = max_queue
        self.step_budget_s = step_budget_s
        self._events = events or (lambda event, **kw: None)
        self._tg: anyio.abc.TaskGroup | None = None
        #: Models taken out of the configuration that still hold memory (until idle).
        self._retiring: list[ServedModel] = []
        self._wake = anyio.Event()
        self._room = anyio.Event()

    @classmethod
    def single(cls, runtime: ModelRuntime, name: str, *, compute: ComputeThread | None = None,
               max_queue: int = 64, step_budget_s: float = 0.05) -> ModelSet:
        """One model its caller loaded and will close (tests, embedding): never unloaded."""
        plan = ModelPlan(name, runtime.config, keep_alive_s=-1.0)
        models = cls([plan], _never, max_queue=max_queue, step_budget_s=step_budget_s)
        models.default.owned = False
        models.adopt(models.default, runtime, compute or ComputeThread())
        return models

    def adopt(self, served: ServedModel, runtime: ModelRuntime, compute: ComputeThread) -> None:
        """A model loaded before :meth:`run` (the default one, at start); its scheduler
        starts with the set."""
        served.runtime, served.compute = runtime, compute
        served.scheduler = self._scheduler(served, runtime, compute)
        served.state = ModelState.LOADED
        _remember(served, runtime)
        self._idle_from(served, time.monotonic())

    def update(self, plans: list[ModelPlan]) -> dict[str, list[str]]:
        """A new configuration (SIGHUP): new models appear at once; removed ones are
        refused from now and unloaded once idle; changed ones reload once idle. A running
        request is never cut. Returns the names added, removed and changed."""
        new = {p.name: p for p in plans}
        out: dict[str, list[str]] = {"added": [], "removed": [], "changed": []}
        for name, served in list(self.models.items()):
            plan = new.get(name)
            if plan is None:
                del self.models[name]
                if served.state is not ModelState.UNLOADED and served.owned:
                    self._retiring.append(served)
                    self.unload_when_idle(served)
                out["removed"].append(name)
            elif _renamed_only(plan, served.plan):
                served.plan = plan  # new aliases or tags: nothing to reload
            elif plan != served.plan and served.owned:
                out["changed"].append(name)
                if served.state is ModelState.UNLOADED:
                    served.plan = plan
                else:
                    served.pending_plan = plan
                    self.unload_when_idle(served)
        for name, plan in new.items():
            if name not in self.models:
                self.models[name] = ServedModel(plan)
                out["added"].append(name)
        self.models = {p.name: self.models[p.name] for p in plans}  # the configured order
        self.default = self.models[plans[0].name]
        return out

    def describe(self) -> None:
        """What each model not loaded yet is, from its file's metadata (a vocabulary-only
        read: no weights, no compute), so listings say its architecture, MTP head and
        chat template before its first load. Blocking; a file that cannot be read is
        left undescribed (its load will say why)."""
        for served in self:
            if served.info is None and served.runtime is None:
                path = served.plan.config.model_path or str(default_model_path())
                try:
                    info, _template = describe_model(path)
                except (NativeError, OSError):
                    continue
                # (a file without a chat template is served with one all the same:
                # ``chat_template.fallback_template``)
                served.info = file_info(attrs.evolve(info, has_chat_template=True),
                                        name=served.name,
                                        n_ctx=served.plan.config.n_ctx_seq)

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self.models.values())

    def get(self, name: str | None) -> ServedModel:
        """The model of that name (None: the default); raises NoSuchModel."""
        if name is None:
            return self.default
        served = self.models.get(name) or next(
            (m for m in self.models.values() if name in m.plan.aliases), None)
        if served is None:
            raise NoSuchModel(name)
        return served

    def loaded(self) -> list[ServedModel]:
        return [m for m in self if m.state is ModelState.LOADED]

    # ------------------------------------------------------------------ running

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Own the schedulers, loads and expiries until cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            for served in self:
                if served.scheduler is not None:
                    await tg.start(self._serve, served)
            tg.start_soon(self._expire)
            task_status.started()

    def _scheduler(self, served: ServedModel, runtime: ModelRuntime,
                   compute: ComputeThread) -> Scheduler:
        return Scheduler(runtime, max_queue=self.max_queue, step_budget_s=self.step_budget_s,
                         compute=compute, counters=served.counters)

    async def _serve(self, served: ServedModel, *,
                     task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                     ) -> None:
        scheduler = served.scheduler
        assert scheduler is not None
        served._stopped = anyio.Event()
        try:
            with anyio.CancelScope() as scope:
                served._scope = scope
                await scheduler.run(task_status=task_status)
        finally:
            served._stopped.set()

    def reconfigure(self, *, max_queue: int, step_budget_s: float) -> None:
        self.max_queue, self.step_budget_s = max_queue, step_budget_s
        for served in self:
            if served.scheduler is not None:
                served.scheduler.max_queue = max_queue
                served.scheduler.step_budget_s = step_budget_s

    # ------------------------------------------------------------------ holding

    async def acquire(self, name: str | None) -> ServedModel:
        """Hold the model (loading it first when it is not loaded) until
        :meth:`release`. Raises NoSuchModel, NoRoom, or LoadFailed."""
        served = self.get(name)
        served.users += 1
        try:
            await self._until_loaded(served)
        except BaseException:
            self.release(served)
            raise
        return served

    def release(self, served: ServedModel, keep_alive_s: float | None = None) -> None:
        """A holder is done; the model expires ``keep_alive_s`` after the last one
        (None: its own keep-alive, else the set's), as Ollama's ``keep_alive``: the
        last request says."""
        served.users -= 1
        served.keep_alive_s = keep_alive_s
        self._idle_from(served, time.monotonic())
        self._wake.set()
        self._room.set()

    def _idle_from(self, served: ServedModel, now: float) -> None:
        served.last_used = now
        keep = 0.0 if served.unload_asked else self.keep_alive_of(served)
        served.expires = expires_at(now, keep) if served.owned else None

    def keep_alive_of(self, served: ServedModel) -> float:
        for choice in (served.keep_alive_s, served.plan.keep_alive_s):
            if choice is not None:
                return choice
        return self.keep_alive_s

    async def _until_loaded(self, served: ServedModel) -> None:
        while served.state is not ModelState.LOADED:
            if served.state is ModelState.UNLOADED:
                assert self._tg is not None, "ModelSet.run is not running"
                served.error = None
                served._set(ModelState.LOADING)
                self._tg.start_soon(self._loading, served)
            elif served.waiting_for_room and served.users > self.max_queue + 1:
                raise NoRoom(self._room_message(served))
            changed = served._changed
            await changed.wait()
            if served.state is ModelState.UNLOADED and served.error is not None:
                raise LoadFailed(served.error)

    def _room_message(self, served: ServedModel) -> str:
        busy = [m.name for m in self if m is not served and m.users > 0
                and m.state is not ModelState.UNLOADED]
        return (f"model {served.name!r} waits for memory held by busy models "
                f"({', '.join(busy) or 'none'}); {served.users - 1} requests already wait "
                f"for it (at most {self.max_queue})")

    # ------------------------------------------------------------------ loading

    async def _loading(self, served: ServedModel) -> None:
        """Make room, load on the model's own thread, start its scheduler. Runs in the
        set's task group: a holder that leaves does not cancel it."""
        compute: ComputeThread | None = None
        try:
            if not await self._make_room(served):
                served._set(ModelState.UNLOADED)  # every holder left while it waited
                return
            self._events("model_loading", model=served.name)
            t0 = time.monotonic()
            compute = ComputeThread(f"meshd-{served.name}")
            runtime = await compute.run(self._load, served.plan)
        except Exception as exc:  # the model's fault (a bad file, no memory): said to holders
            if compute is not None:
                await anyio.to_thread.run_sync(compute.close)
            served.error = str(exc) or type(exc).__name__
            self._events("model_load_failed", model=served.name, error=served.error)
            served._set(ModelState.UNLOADED)
            self._room.set()
            return
        served.runtime, served.compute = runtime, compute
        served.scheduler = self._scheduler(served, runtime, compute)
        _remember(served, runtime)
        assert self._tg is not None
        await self._tg.start(self._serve, served)
        self._idle_from(served, time.monotonic())
        served._set(ModelState.LOADED)
        self._events("model_loaded", model=served.name,
                     seconds=round(time.monotonic() - t0, 2))
        self._wake.set()

    async def _make_room(self, served: ServedModel) -> bool:
        """Unload least recently used idle models until ``served`` fits the limits;
        wait while only busy ones could make room. False: nobody wants it any more."""
        while True:
            residents = [Resident(m.name, m.plan.size_bytes,
                                  busy=m.users > 0 or m.state is not ModelState.LOADED,
                                  last_used=m.last_used)
                         for m in [*self, *self._retiring]
                         if m is not served and m.state is not ModelState.UNLOADED
                         and not m.waiting_for_room]  # (a model waiting holds no room yet)
            chosen = room_for(residents, served.plan.size_bytes, max_loaded=self.max_loaded,
                              memory_limit=self.memory_limit)
            if chosen == []:
                served.waiting_for_room = False
                return True
            if chosen is None:
                if served.users == 0:
                    served.waiting_for_room = False
                    return False
                served.waiting_for_room = True
                if self._room.is_set():  # (one event for every model waiting for room)
                    self._room = anyio.Event()
                await self._room.wait()
                continue
            holding = {m.name: m for m in [*self, *self._retiring]}
            for name in chosen:
                await self.unload(holding[name], reason="room")

    def unload_when_idle(self, served: ServedModel) -> None:
        """Unload it as soon as no request holds it (at once if none does)."""
        if served.owned and served.state is not ModelState.UNLOADED:
            served.unload_asked = True
            if served.users == 0:
                self._idle_from(served, time.monotonic())
            self._wake.set()

    async def unload(self, served: ServedModel, *, reason: str) -> bool:
        """Unload an idle model now; False when it is busy, not loaded, or not ours."""
        if served.state is not ModelState.LOADED or served.users > 0 or not served.owned:
            return False
        served._set(ModelState.UNLOADING)
        t0 = time.monotonic()
        try:
            if served._scope is not None:
                served._scope.cancel()
            await served._stopped.wait()
            runtime, compute = served.runtime, served.compute
            served.runtime = served.scheduler = served.compute = None
            served._scope = None
            with anyio.CancelScope(shield=True):
                if compute is not None:
                    if runtime is not None:
                        await compute.run(runtime.close)
                    await anyio.to_thread.run_sync(compute.close)
                del runtime
                gc.collect()
                _trim_heap()
        finally:
            served.unload_asked = False
            if served.pending_plan is not None:
                served.plan, served.pending_plan = served.pending_plan, None
            if served in self._retiring:
                self._retiring.remove(served)
            served._set(ModelState.UNLOADED)
            self._room.set()
        self._events("model_unloaded", model=served.name, reason=reason,
                     seconds=round(time.monotonic() - t0, 2))
        return True

    async def _expire(self) -> None:
        """Unload idle models whose keep-alive ran out."""
        while True:
            now = time.monotonic()
            for served in [*self, *self._retiring]:
                if (served.expires is not None and served.expires <= now
                        and served.users == 0 and served.state is ModelState.LOADED
                        and not _has_connected_plugins(served)):
                    try:
                        await self.unload(served, reason="keep_alive")
                    except Exception as exc:  # (closing failed: the others still expire)
                        self._events("model_unload_failed", model=served.name,
                                     error=str(exc) or type(exc).__name__)
            due = [m.expires for m in [*self, *self._retiring] if m.expires is not None
                   and m.users == 0 and m.state is ModelState.LOADED
                   and not _has_connected_plugins(m)]
            self._wake = anyio.Event()
            wake = self._wake
            with anyio.move_on_after(max(0.0, min(due) - time.monotonic()) if due else None):
                await wake.wait()

    def close(self) -> None:
        """Close every model the set loaded (after :meth:`run`; blocking)."""
        for served in [*self, *self._retiring]:
            runtime, compute = served.runtime, served.compute
            if served.owned and compute is not None:
                if runtime is not None:
                    compute.call(runtime.close)
                compute.close()
            served.runtime = served.scheduler = served.compute = None
            served.state = ModelState.UNLOADED


def _has_connected_plugins(served: ServedModel) -> bool:
    """Plugins that connected to the model do not reconnect after an unload: while one
    is linked, the model's keep-alive does not run out (other unloads still happen)."""
    return served.runtime is not None and served.runtime.plugins.connected()


def _remember(served: ServedModel, runtime: ModelRuntime) -> None:
    """What the model is, kept for listings after it unloads."""
    served.info = attrs.evolve(model_info(runtime, name=served.name),
                               proposers=tuple(runtime.usable_proposers()))


def _never(plan: ModelPlan) -> ModelRuntime:
    raise LoadFailed(f"model {plan.name!r} is not loaded and cannot be loaded here")


def _trim_heap() -> None:
    """Give freed heap pages back to the system, so an unloaded model's memory shows
    as gone (glibc keeps freed arenas otherwise)."""
    name = ctypes.util.find_library("c")
    if name and os.name == "posix":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(name).malloc_trim(0)

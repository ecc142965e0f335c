"""Proposer discovery: one registry for built-in and third-party proposers.

Why entry points for built-ins too: wired in by import, they would leave the third-party
path a second, less-tested one. So every proposer, ours included (``draft`` too), is a
factory in the ``meshd.proposers`` entry-point group, and the path a plugin takes is the
one the built-ins exercise on every start. A plugin that fails to import is recorded in
:attr:`Registry.errors` and logged, never fatal. Factories may also be registered
programmatically (:meth:`Registry.register`). Third-party proposers that touch no
llama.cpp object are *isolatable*: :meth:`Registry.create` wraps them to run on a worker
thread under a deadline (:mod:`meshd.plugins.guard`); built-ins stay on the compute
thread. :meth:`Registry.entries` describes them all (``meshd plugins list``).
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Mapping

import attrs

from .base import Capabilities, Proposer, ProposerEnv, ProposerFactory, ProposerUnavailable
from .guard import PluginGuards
from .resources import Need, needs_of

#: The entry-point group every proposer factory is published under.
GROUP = "meshd.proposers"
#: The distribution whose entry points are built-ins (trusted to run on the compute thread).
OWN_DISTRIBUTION = "meshd"
#: Resources that are llama.cpp objects: a factory declaring one stays on the compute thread.
_NATIVE_NEEDS = frozenset({Need.DRAFT_MODEL, Need.REGISTRY})

log = logging.getLogger(__name__)


class UnknownProposer(LookupError):
    """No proposer of that name is registered; the message lists the available ones."""

    def __init__(self, name: str, available: list[str], errors: Mapping[str, str]) -> None:
        self.name = name
        self.available = available
        msg = f"unknown proposer {name!r}; available: {', '.join(available) or '(none)'}"
        if name in errors:
            msg += f" ({name!r} failed to load: {errors[name]})"
        super().__init__(msg)


class ProposerFailed(RuntimeError):
    """A factory raised something other than :class:`ProposerUnavailable`."""


@attrs.frozen
class Entry:
    """One discovered proposer, as ``meshd plugins list`` shows it."""

    name: str
    origin: str
    loaded: bool
    error: str | None = None
    needs: frozenset[Need] = frozenset()
    #: Declared on the factory (``factory.capabilities``); None when only the proposer
    #: made for a request knows them.
    capabilities: Capabilities | None = None


_REQUIRED = ("name", "capabilities", "propose", "observe", "close")


class Registry:
    """Name -> factory. Create with :meth:`load` (entry points) or empty for tests."""

    def __init__(self) -> None:
        self._factories: dict[str, ProposerFactory] = {}
        self._origins: dict[str, str] = {}
        #: Names whose factory came from another distribution than meshd's own.
        self._third_party: set[str] = set()
        #: name -> "where: what went wrong" for plugins that could not be loaded.
        self.errors: dict[str, str] = {}
        #: Set by the runtime: isolated plugins' workers (see :meth:`create`).
        self.guards: PluginGuards | None = None

    @classmethod
    def load(cls, group: str = GROUP) -> Registry:
        """Discover every factory in the entry-point ``group``; failures go to ``errors``.

        Loads eagerly so a broken plugin is reported at start-up, not on the first
        request that names it. The first distribution to claim a name wins; later claims
        are reported as errors rather than silently shadowing it.
        """
        registry = cls()
        for ep in importlib.metadata.entry_points(group=group):
            dist = ep.dist
            origin = f"{ep.value} ({dist.name} {dist.version})" if dist is not None else ep.value
            registry._origins.setdefault(ep.name, origin)
            if ep.name in registry._factories:
                registry._error(
                    ep.name, f"{origin}: duplicate name, keeping {registry._origins[ep.name]}"
                )
                continue
            try:
                factory = ep.load()
            except Exception as exc:  # a plugin's import may fail in any way
                registry._error(ep.name, f"{origin}: {type(exc).__name__}: {exc}")
                continue
            if not callable(factory):
                registry._error(ep.name, f"{origin}: not callable")
                continue
            registry._factories[ep.name] = factory
            registry._origins[ep.name] = origin
            if dist is None or dist.name != OWN_DISTRIBUTION:
                registry._third_party.add(ep.name)
        return registry

    def _error(self, name: str, message: str) -> None:
        log.warning("proposer plugin %r not loaded: %s", name, message)
        self.errors[name] = message

    def needs(self, name: str) -> frozenset[Need]:
        """The resources the factory for ``name`` declared."""
        return needs_of(self._factories.get(name))

    def entries(self) -> list[Entry]:
        """Every discovered proposer, loaded or not, sorted by name."""
        out: list[Entry] = []
        for name in sorted({*self._factories, *self.errors}):
            factory = self._factories.get(name)
            caps = getattr(factory, "capabilities", None)
            out.append(Entry(
                name=name, origin=self._origins.get(name, "?"), loaded=factory is not None,
                error=self.errors.get(name), needs=needs_of(factory),
                capabilities=caps if isinstance(caps, Capabilities) else None,
            ))
        return out

    def built_in(self, name: str) -> bool:
        """Whether ``name`` is one of meshd's own proposers (an entry point of this
        distribution, or registered without ``third_party``): only those are handed the
        model's history (:class:`~meshd.plugins.resources.Need` ``HISTORY``), which holds
        every owner's answers."""
        return name in self._factories and name not in self._third_party

    def isolatable(self, name: str) -> bool:
        """Whether ``name`` is a third-party proposer that touches no llama.cpp object
        (declares neither a draft model nor the registry), so its calls may run off the
        compute thread (a proposer that needs the MTP head is kept there by
        :meth:`create`)."""
        return name in self._third_party and not self.needs(name) & _NATIVE_NEEDS

    def register(self, name: str, factory: ProposerFactory, *, replace: bool = False,
                 third_party: bool = False) -> None:
        """Add a factory under ``name`` (``replace=True`` to override an existing one;
        ``third_party=True`` treats it as an entry point of another distribution)."""
        if not name:
            raise ValueError("proposer name must be non-empty")
        if not callable(factory):
            raise TypeError(f"factory for {name!r} is not callable")
        if name in self._factories and not replace:
            raise ValueError(f"proposer {name!r} already registered ({self._origins[name]})")
        self._factories[name] = factory
        self._origins[name] = getattr(factory, "__qualname__", repr(factory))
        self.errors.pop(name, None)
        if third_party:
            self._third_party.add(name)
        else:
            self._third_party.discard(name)

    def copy(self) -> Registry:
        """An independent registry with the same factories (to add a daemon's own)."""
        other = Registry()
        other._factories = dict(self._factories)
        other._origins = dict(self._origins)
        other._third_party = set(self._third_party)
        other.errors = dict(self.errors)
        return other

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a plugin that went away); unknown names are ignored."""
        self._factories.pop(name, None)
        self._origins.pop(name, None)
        self._third_party.discard(name)

    def names(self) -> list[str]:
        """Names that can be created, sorted."""
        return sorted(self._factories)

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def create(self, name: str, env: ProposerEnv) -> Proposer:
        """A new proposer for one request.

        Raises :class:`UnknownProposer` for an unregistered name,
        :class:`ProposerUnavailable` when the factory declines this request (passed
        through: it is an expected answer, e.g. ``mtp`` on a model without a head), and
        :class:`ProposerFailed` when the factory breaks or returns something that is not
        a proposer. An isolatable proposer is returned wrapped by its guard, when
        :attr:`guards` has one for it (not if it needs the MTP head).
        """
        factory = self._factories.get(name)
        if factory is None:
            raise UnknownProposer(name, self.names(), self.errors)
        try:
            proposer = factory(env)
        except ProposerUnavailable:
            raise
        except Exception as exc:
            raise ProposerFailed(
                f"proposer {name!r} ({self._origins[name]}) failed: {type(exc).__name__}: {exc}"
            ) from exc
        missing = [attr for attr in _REQUIRED if not hasattr(proposer, attr)]
        if missing:
            raise ProposerFailed(
                f"proposer {name!r} ({self._origins[name]}) returned {type(proposer).__name__}"
                f" without {', '.join(missing)}"
            )
        guard = self.guards.get(name) if self.guards is not None else None
        if guard is not None and not getattr(proposer.capabilities, "needs_mtp_head", False):
            return guard.wrap(proposer, env.vocab_size)
        return proposer


_default: Registry | None = None


def default_registry() -> Registry:
    """The process-wide registry loaded from entry points (loaded once, on first use)."""
    global _default
    if _default is None:
        _default = Registry.load()
    return _default


# Option helpers shared by the built-in factories: ``ProposerEnv.options`` comes from
# config files and requests, so values are checked here and a bad one is reported by key.


def int_option(options: Mapping[str, object], key: str, default: int, *, minimum: int = 0) -> int:
    """``options[key]`` as an int >= ``minimum`` (bools are rejected), else ``default``."""
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"option {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"option {key!r} must be >= {minimum}, got {value}")
    return value


def float_option(
    options: Mapping[str, object],
    key: str,
    default: float,
    *,
    minimum: float = float("-inf"),
    maximum: float = float("inf"),
) -> float:
    """``options[key]`` as a float in ``[minimum, maximum]``, else ``default``."""
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"option {key!r} must be a number, got {value!r}")
    if not minimum <= value <= maximum:
        raise ValueError(f"option {key!r} must be in [{minimum}, {maximum}], got {value}")
    return float(value)


def bool_option(options: Mapping[str, object], key: str, default: bool) -> bool:
    """``options[key]`` as a bool, else ``default``."""
    value = options.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"option {key!r} must be true or false, got {value!r}")
    return value

"""Room for one more model: which idle models to unload, and never a busy one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from meshd.policy.residency import Resident, expires_at, room_for

residents = st.lists(
    st.builds(Resident, name=st.text("abcdef", min_size=1, max_size=3),
              size_bytes=st.integers(1, 100), busy=st.booleans(),
              last_used=st.floats(0, 1000)),
    max_size=6, unique_by=lambda r: r.name)
limits = st.one_of(st.none(), st.integers(1, 6))
memory = st.one_of(st.none(), st.integers(1, 400))


def test_the_least_recently_used_idle_model_goes_first() -> None:
    loaded = [Resident("a", 10, False, 5.0), Resident("b", 10, False, 1.0),
              Resident("c", 10, True, 0.0)]
    assert room_for(loaded, 10, max_loaded=3, memory_limit=None) == ["b"]
    assert room_for(loaded, 10, max_loaded=2, memory_limit=None) == ["b", "a"]
    assert room_for(loaded, 10, max_loaded=1, memory_limit=None) is None  # c is busy
    assert room_for(loaded, 5, max_loaded=None, memory_limit=40) == []
    assert room_for(loaded, 25, max_loaded=None, memory_limit=40) == ["b", "a"]


@given(residents, st.integers(1, 100), limits, memory)
def test_room_is_made_from_idle_models_only_and_is_enough(
        loaded: list[Resident], size: int, max_loaded: int | None,
        memory_limit: int | None) -> None:
    chosen = room_for(loaded, size, max_loaded=max_loaded, memory_limit=memory_limit)
    idle = sorted((r for r in loaded if not r.busy), key=lambda r: r.last_used)
    if chosen is None:
        # Even with every idle model gone it would not fit.
        rest = [r for r in loaded if r.busy]
        assert ((max_loaded is not None and len(rest) + 1 > max_loaded)
                or (memory_limit is not None
                    and sum(r.size_bytes for r in rest) + size > memory_limit))
        return
    assert chosen == [r.name for r in idle[:len(chosen)]]  # LRU order, a prefix
    kept = [r for r in loaded if r.name not in chosen]
    assert max_loaded is None or len(kept) + 1 <= max_loaded
    assert memory_limit is None or sum(r.size_bytes for r in kept) + size <= memory_limit
    if chosen:  # minimal: one fewer would not have been enough
        fewer = [*kept, next(r for r in loaded if r.name == chosen[-1])]
        assert not ((max_loaded is None or len(fewer) + 1 <= max_loaded)
                    and (memory_limit is None
                         or sum(r.size_bytes for r in fewer) + size <= memory_limit))


def test_keep_alive() -> None:
    assert expires_at(100.0, 300.0) == 400.0
    assert expires_at(100.0, 0.0) == 100.0
    assert expires_at(100.0, -1.0) is None

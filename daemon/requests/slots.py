"""What each slot of a model's shared context is doing, as a record a front end formats.

Why here: the running generations are the engine's objects; a front end (llama-server's
``GET /slots``) shows only what a slot is doing (busy or idle, how far along), never
the generation itself, and never another user's prompt or text.
"""

from __future__ import annotations

import attrs

from meshd.daemon.models.model_set import ServedModel

__all__ = ["SlotState", "Slots", "model_slots"]


@attrs.frozen
class SlotState:
    """One slot (a sequence of the shared context): idle, or the generation it serves."""

    id: int
    processing: bool
    has_next_token: bool
    n_remain: int
    """Tokens the generation may still make (-1: idle)."""
    n_decoded: int


@attrs.frozen
class Slots:
    """A model's slots (every one idle while the model is not loaded)."""

    n_ctx: int
    speculative: bool
    slots: tuple[SlotState, ...]

    @property
    def all_busy(self) -> bool:
        return all(s.processing for s in self.slots)


def model_slots(served: ServedModel) -> Slots:
    """The slots of ``served`` now."""
    rt, scheduler = served.runtime, served.scheduler
    if rt is not None and scheduler is not None:
        config = rt.context.config
        n_slots, n_ctx, running = config.n_seq_max, config.n_ctx_seq, scheduler.running()
    else:
        plan = served.plan.config
        n_slots, n_ctx, running = plan.n_seq_max, plan.n_ctx_seq, []
    speculative = (served.plan.config.default_proposer != "off"
                   and served.plan.config.draft_max > 0)
    busy = {gen.session.seq_id: gen for gen in running}
    states = []
    for slot in range(n_slots):
        gen = busy.get(slot)
        decoded = len(gen.committed) if gen is not None else 0
        states.append(SlotState(
            id=slot, processing=gen is not None,
            has_next_token=gen is not None and not gen.done,
            n_remain=gen.max_tokens - decoded if gen is not None else -1,
            n_decoded=decoded))
    return Slots(n_ctx=n_ctx, speculative=speculative, slots=tuple(states))

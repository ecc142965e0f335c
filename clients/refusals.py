"""What each refusal reason in ``done.speculation.refusals`` means, for people.

Why in the clients: ``meshctl generate --explain`` prints these next to the counts, and
the table in protocol/PROTOCOL.md says the same; a test checks that both cover exactly
the reasons the daemon counts (``meshd.policy.gate.Refusal``), so a new reason cannot
ship unexplained. The clients do not import the policy (the layering), hence the copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

__all__ = ["REFUSAL_REASONS", "explain_refusals"]

REFUSAL_REASONS: Final[Mapping[str, str]] = MappingProxyType({
    "unseeded_sampling": "sampling at temperature > 0 without a seed cannot be verified "
                         "exactly, so the step decoded plainly (give a seed to speculate)",
    "budget": "no room for a draft: the last token of max_tokens, or the context is full",
    "mtp_head_dropped": "following the model's MTP head cost more than its drafts saved, "
                        "so the request dropped the head and decoded the rest plainly "
                        "(counted once)",
    "cost_model": "the measured cost curve said no draft length would pay at this "
                  "proposer's acceptance so far, so the step decoded plainly",
    "proposer_empty": "the proposer was asked and had no draft (e.g. n-gram lookup "
                      "found no earlier match); the step decoded plainly",
    "shared_plan": "other requests shared this step's forward, and the plan for the "
                   "whole group (their rows priced together, or drafting held off where "
                   "it measurably earned less than plain steps) gave this request no "
                   "draft, so the step decoded plainly",
})
"""Reason -> why drafting was skipped on a step, in one sentence."""


def explain_refusals(refusals: Mapping[str, int]) -> list[str]:
    """One line per reason in ``refusals`` (most frequent first): count and meaning."""
    return [
        f"  {reason} x{count}: "
        + REFUSAL_REASONS.get(reason, "not known to this meshctl (a newer daemon?)")
        for reason, count in sorted(refusals.items(), key=lambda kv: (-kv[1], kv[0]))
    ]

"""Whether ``auto`` follows the MTP head for a new request, from how earlier ones ended.

Why: following the head costs a catch-up forward after every target forward, so a
request that ends up not drafting with it (the cost model never finds a length that
pays, and the step gate drops the head) has paid for nothing. Pooled acceptance
(:class:`~meshd.policy.acceptance.PooledAcceptance`) says so only once many drafts were
verified, which a head that is rarely worth drafting never provides. So the outcome of
each request that followed the head is remembered too: after a request dropped it,
``auto`` serves the next ones without it, and follows it again now and then (every
``explore_every`` requests, the interval doubling while it keeps being dropped, up to
``max_every``) in case what it is asked has changed. Sans-I/O and deterministic.
"""

from __future__ import annotations


class HeadChoice:
    """Per model: the MTP head's record over the requests ``auto`` gave it."""

    def __init__(self, *, explore_every: int = 4, max_every: int = 32) -> None:
        if explore_every < 1 or max_every < explore_every:
            raise ValueError("need 1 <= explore_every <= max_every")
        self.explore_every = explore_every
        self.max_every = max_every
        #: Requests in a row that followed the head and dropped it.
        self.dropped_in_a_row = 0
        #: Requests served without the head since the last one that followed it.
        self.skipped = 0

    @property
    def interval(self) -> int:
        """Requests served without the head before it is tried again."""
        if self.dropped_in_a_row == 0:
            return 0
        return min(self.max_every, self.explore_every << (self.dropped_in_a_row - 1))

    @property
    def due(self) -> bool:
        """Whether the next request should follow the head."""
        return self.skipped >= self.interval

    def skip(self) -> None:
        """A request was served without the head (it was not due)."""
        self.skipped += 1

    def following(self) -> None:
        """A request follows the head. While the head stands dropped it explores alone:
        the requests that start before it ends are served without the head."""
        if self.dropped_in_a_row:
            self.skipped = 0

    def ended(self, *, dropped: bool) -> None:
        """A request that followed the head ended, having dropped it or not."""
        self.dropped_in_a_row = self.dropped_in_a_row + 1 if dropped else 0
        self.skipped = 0

"""The width policy a round asks: how wide this step's verify is, and what it keeps.

Two policies share one interface, so the round has no branch on which one serves:

* :class:`FixedWidth` (``--speculative-ddtree-budget N``): the server's width every step;
  every hook is a no-op.
* :class:`~.widths.StepWidths` (``--speculative-ddtree-budget auto``): a width chosen per
  step from the drafter's predicted acceptance and measured round costs; its hooks keep
  what the choice reads (the step's draft log-probs, its verify's time, its accept lengths).
"""

from __future__ import annotations


class FixedWidth:
    """The verify width of a fixed budget, every step."""

    skips_draft = False  # a fixed budget drafts every step

    def __init__(self, head):
        self.head = head
        self.widths = (head.width,)
        self.heads = {head.width: head}

    def summary(self) -> dict:
        """Nothing of its own for the stats line."""
        return {}

    def start(self, bs: int) -> int:
        return self.head.width

    def interrupt(self, joined: int = 0) -> None:
        """A prefill or idle pass between steps: nothing to account."""

    def head_for(self, width: int):
        return self.heads[width]

    def watch(self, propose):
        return propose

    def graph_proposal(self, proposal, max_bs: int, device):
        return proposal

    def from_graph(self, replayed):
        return replayed

    def verify_started(self) -> None:
        pass

    def verify_finished(self) -> None:
        pass

    def finish(self, accept_lens) -> None:
        pass

    def install_graphs(self, target_runner, draft_runner, roots_append: bool = False) -> list:
        """The target's extra verify graph backends (none: the server's own graphs verify)."""
        return []

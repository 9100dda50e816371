"""Search spaces whose trials share prefixes and branch at a few steps, for the tests
that check a study trains each step once."""

from __future__ import annotations

from stagetree.distributions import Choice
from stagetree.hp import MultiStep, Piecewise
from stagetree.space import RandomSpace

# Sequences that change value at a few steps: trials share prefixes and branch there.
MIXED = RandomSpace(
    hp={
        "lr": MultiStep(
            init=Choice([0.03, 0.1]),
            milestones=Choice([[2], [6], [2, 6], [10]]),
            gamma=Choice([0.1, 0.3, 0.5]),
        ),
        "batch_size": Choice([64, Piecewise([64, 128], [6])]),
    }
)

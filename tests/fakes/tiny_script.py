"""A study script for ``stagetree simulate`` tests: two trials of one plan tree (a
constant learning rate and one that decays at step 4), a grid to 8 steps: 16 requested
steps, 12 unique."""

from __future__ import annotations

import textwrap
from pathlib import Path


def tiny_script(path: Path, study_options: str = 'storage="memory://"') -> Path:
    """Write the script to ``path`` (its study: ``Study("tiny", Tiny, <study_options>)``)
    and return ``path``."""
    path.write_text(
        textwrap.dedent(
            f"""
            from stagetree import Study, Trainer
            from stagetree.hp import Constant, MultiStep
            from stagetree.space import GridSpace
            from stagetree.tuners import GridSearch

            class Tiny(Trainer):
                pass

            space = GridSpace(hp={{"lr": [Constant(0.1), MultiStep(0.1, [4], 0.1)]}})
            tuner = GridSearch(space, "accuracy", steps=8)
            study = Study("tiny", Tiny, {study_options})
            """
        )
    )
    return path

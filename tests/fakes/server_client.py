"""A client process of the server end-to-end tests (tests/server/test_server_e2e.py).

``python server_client.py URL TOKEN_FILE STUDY WEIGHT SPACE OUT [BARRIER...]``: opens
study STUDY on the tuning server at URL with SlowLinearTrainer, writes ``OUT.ready``,
waits until every BARRIER file exists (so that several clients submit at the same
moment), submits every trial of SPACE (``a`` or ``b``, see :func:`space`) at once and
writes their final metrics to OUT as JSON. No main guard needed by the library: the
trainer travels by import path (this directory is on the server's ``PYTHONPATH``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from study_trainers import SlowLinearTrainer

from stagetree import Study
from stagetree.hp import Constant, MultiStep, Sequence

STEPS = 50


def space(which: str) -> list[tuple[dict[str, Any], dict[str, Sequence]]]:
    """The trials of client ``a`` or ``b``: both continue one shared tree (seed 0: the
    same learning rate for 20, 30 or 40 steps, then halved; ``b`` repeats one of
    ``a``'s trials exactly), and each has six trials of its own (other seeds)."""
    shared = {"a": [20, 30], "b": [30, 40]}[which]
    own = {"a": range(10, 16), "b": range(20, 26)}[which]
    trials: list[tuple[dict[str, Any], dict[str, Sequence]]] = [
        ({"seed": 0}, {"lr": MultiStep(0.05, [m], 0.5)}) for m in shared
    ]
    trials += [({"seed": s}, {"lr": Constant(0.03)}) for s in own]
    return trials


def key(config: dict[str, Any], hp: dict[str, Sequence]) -> str:
    from stagetree.hp import dumps_hp

    return json.dumps(config, sort_keys=True) + dumps_hp(hp)


async def main(argv: list[str]) -> None:
    url, token_file, name, weight, which, out, *barriers = argv
    token = Path(token_file).read_text().strip()
    study = Study(name, SlowLinearTrainer, url=url, token=token, weight=float(weight))
    study.open()
    Path(out + ".ready").write_text("ready")
    while not all(Path(b).exists() for b in barriers):
        time.sleep(0.02)
    trials = space(which)
    results = await asyncio.gather(*(study.submit(c, h, STEPS) for c, h in trials))
    Path(out).write_text(
        json.dumps({key(c, h): r.metrics for (c, h), r in zip(trials, results)}, sort_keys=True)
    )
    study.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))

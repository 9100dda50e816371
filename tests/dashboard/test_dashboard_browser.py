"""The dashboard in a real browser: Debian's Chromium, driven by Playwright, over the real
back end (:func:`stagetree.dashboard.serve.start_dashboard` on a free loopback port)
reading a SQLite plan while a study runs in this process.

The study's trainer waits at a gate before its first step, so the page first shows the
whole plan pending; the test opens the gate and watches a node turn trained without a
reload. The other tests read the finished study. One browser and one server per
module; screenshots of every view go to ``$STAGETREE_ARTIFACTS`` (default: the
temporary directory's ``stagetree-dashboard-artifacts``), outside the repository.

Playwright never downloads a browser here: it launches ``/usr/bin/chromium``. Without
it (or without playwright) the tests skip, unless ``STAGETREE_REQUIRE_BROWSER`` is set
(CI), where they fail.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from study_trainers import LinearTrainer

from stagetree import Study
from stagetree.hp import Constant, MultiStep
from stagetree.plan import open_storage
from stagetree.space import GridSpace
from stagetree.tuners import GridSearch

CHROMIUM = "/usr/bin/chromium"
STUDY = "demo"
STEPS = 12
LRS = [
    Constant(0.05),
    MultiStep(0.05, [4], 0.1),  # 0.005 from step 4
    MultiStep(0.05, [4], 0.01),
    MultiStep(0.05, [8], 0.1),
    MultiStep(0.05, [8], 4.0),
    MultiStep(0.05, [4, 8], 0.5),
]
GATE = threading.Event()
TIMEOUT_MS = 20_000


class GatedTrainer(LinearTrainer):
    """LinearTrainer whose steps wait for the module's gate (and take 5 ms)."""

    def train(self) -> dict[str, float]:
        GATE.wait(60)
        time.sleep(0.005)
        return super().train()


def _artifacts() -> Path:
    root = os.environ.get("STAGETREE_ARTIFACTS") or tempfile.gettempdir()
    path = Path(root) / "stagetree-dashboard-artifacts"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _browser_missing() -> str | None:
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright; it uses Debian's chromium)"
    return None


@dataclass
class Site:
    """The dashboard over a running (then finished) study."""

    base: str
    url: str
    study: threading.Thread
    errors: list[BaseException]

    def finished(self) -> None:
        """Open the gate and wait for the study to end."""
        GATE.set()
        self.study.join(60)
        assert not self.study.is_alive(), "the study did not finish"
        assert not self.errors, self.errors

    def storage(self) -> Any:
        return open_storage(self.url)


@pytest.fixture(scope="module", autouse=True)
def _browser() -> None:
    missing = _browser_missing()
    if missing:
        if os.environ.get("STAGETREE_REQUIRE_BROWSER"):
            pytest.fail(f"the dashboard's browser tests must run here: {missing}")
        pytest.skip(missing)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    from stagetree.dashboard.serve import start_dashboard

    GATE.clear()
    url = f"sqlite:///{tmp_path_factory.mktemp('dashboard')}/plan.db"
    errors: list[BaseException] = []

    def run() -> None:
        try:
            space = GridSpace({"lr": LRS}, fixed={"seed": [0]})
            with Study(STUDY, GatedTrainer, storage=url, executor="inline") as study:
                study.tune(GridSearch(space, "score", steps=STEPS))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name="dashboard-study", daemon=True)
    thread.start()
    # the plan holds every trial's path before anything trains (the gate is shut)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not errors:
        if os.path.exists(url[len("sqlite:///") :]):
            storage = open_storage(url)
            try:
                if len(storage.trials(STUDY)) == len(LRS):
                    break
            finally:
                storage.close()
        time.sleep(0.05)
    assert not errors, errors
    server = start_dashboard(url)
    try:
        yield Site(server.url.rstrip("/"), url, thread, errors)
    finally:
        GATE.set()
        thread.join(60)
        server.stop()


@pytest.fixture(scope="module")
def page(site: Site) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        context.set_default_timeout(TIMEOUT_MS)
        pg = context.new_page()
        problems: list[str] = []
        pg.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
        try:
            yield pg
        finally:
            browser.close()
    assert not problems, problems


def _open(page: Any, site: Site, path: str) -> None:
    page.goto(site.base + path)
    page.wait_for_function("window.stagetree && window.stagetree.ready")


def _shot(page: Any, name: str) -> None:
    page.screenshot(path=str(_artifacts() / f"{name}.png"))


def _roots(storage: Any) -> set[str]:
    return {str(t["root_key"]) for t in storage.trials(STUDY)}


def _plan_nodes(site: Site) -> list[Any]:
    """Every plan node of the study's trees, read through a handle of its own."""
    storage = site.storage()
    try:
        return [n for root in sorted(_roots(storage)) for n in storage.nodes(root)]
    finally:
        storage.close()


# --------------------------------------------------------------------------- live


def test_a_node_turns_trained_while_the_study_runs_without_a_reload(page: Any, site: Site) -> None:
    nodes = _plan_nodes(site)
    _open(page, site, f"/study/{STUDY}")
    page.wait_for_function(f"document.querySelectorAll('.node').length === {len(nodes)}")
    leaf = max(n.id for n in nodes)  # a leaf: trained last
    assert page.get_attribute(f'.node[data-node="{leaf}"]', "data-state") == "pending"
    _shot(page, "tree-pending")
    page.evaluate("window.__sameDocument = true")
    GATE.set()
    page.wait_for_function(
        f"document.querySelector('.node[data-node=\"{leaf}\"]').dataset.state === 'trained'"
    )
    assert page.evaluate("window.__sameDocument === true"), "the page was reloaded"
    site.finished()


# --------------------------------------------------------------------------- views


def test_studies_list_shows_the_study_and_its_best_metric(page: Any, site: Site) -> None:
    site.finished()
    from stagetree.reports.trials import best_trial, trial_records

    storage = site.storage()
    try:
        best = best_trial(trial_records(storage, STUDY), "score", "max")
    finally:
        storage.close()
    assert best is not None
    value = best.metrics[best.steps]["score"]
    _open(page, site, "/")
    row = page.locator(f'tr[data-study="{STUDY}"]')
    text = row.inner_text()
    assert STUDY in text and "finished" in text
    assert f"{value:.4g}".replace("-", "\u2212") in text  # d3 writes a minus sign
    assert f"trial #{best.id}" in text
    _shot(page, "studies")
    row.click()  # a click opens the study
    page.wait_for_url(f"**/study/{STUDY}")
    page.wait_for_selector(".node")


def test_the_tree_has_one_element_per_plan_node(page: Any, site: Site) -> None:
    site.finished()
    nodes = _plan_nodes(site)
    _open(page, site, f"/study/{STUDY}")
    assert page.locator(".node").count() == len(nodes)
    assert page.evaluate("window.stagetree.rendered") == len(nodes)
    assert page.evaluate("window.stagetree.tree.nodes.size") == len(nodes)
    ids = page.eval_on_selector_all(".node", "els => els.map(e => +e.dataset.node)")
    assert sorted(ids) == sorted(n.id for n in nodes)
    states = set(page.eval_on_selector_all(".node", "els => els.map(e => e.dataset.state)"))
    assert states == {"trained"}
    assert page.locator(".node .ckpt").count() > 0  # checkpoints are marked
    assert "training step" in (page.text_content(".tree-axis") or "")


def test_hover_shows_the_sequence_values(page: Any, site: Site) -> None:
    site.finished()
    node = next(  # the node where lr drops to 0.005 at step 4
        n
        for n in _plan_nodes(site)
        if n.branch_step == 4 and abs(float(n.hp["lr"](4)) - 0.005) < 1e-12
    )
    _open(page, site, f"/study/{STUDY}")
    page.hover(f'.node[data-node="{node.id}"]')
    page.wait_for_selector('#node-panel .hp[data-hp="lr"]')
    panel = page.inner_text("#node-panel")
    assert f"Node #{node.id}" in panel
    assert "0.005" in panel and "4\u201312" in panel  # the value over its steps 4-12
    assert "score" in panel  # the metrics reached
    _shot(page, "tree-hover")


def test_learning_curves_draw_one_line_per_trial(page: Any, site: Site) -> None:
    site.finished()
    storage = site.storage()
    try:
        trials = [int(t["id"]) for t in storage.trials(STUDY)]
    finally:
        storage.close()
    _open(page, site, f"/study/{STUDY}/curves")
    drawn = page.eval_on_selector_all(".curve", "els => els.map(e => +e.dataset.trial)")
    assert sorted(drawn) == sorted(trials)
    assert page.locator("path.shared").count() > 0  # the shared prefix, drawn once
    assert "best #" in (page.text_content(".curves-svg") or "")
    _shot(page, "curves")


def test_trials_table_has_a_row_per_trial_and_sorts(page: Any, site: Site) -> None:
    site.finished()
    _open(page, site, f"/study/{STUDY}/trials")
    rows = page.locator("tbody tr[data-trial]")
    assert rows.count() == len(LRS)

    def column(key: str) -> list[float]:
        index = page.eval_on_selector_all(
            "thead th", f"ths => ths.findIndex(t => t.dataset.key === {key!r})"
        )
        texts = page.eval_on_selector_all(
            "tbody tr[data-trial]", f"trs => trs.map(r => r.cells[{index}].innerText)"
        )
        return [float(t.replace("\u2212", "-")) for t in texts]

    page.click('th[data-key="m:score"]')
    ascending = column("m:score")
    assert ascending == sorted(ascending)
    page.click('th[data-key="m:score"]')
    assert column("m:score") == sorted(ascending, reverse=True)
    link = page.locator("a.download").first
    response = page.request.get(site.base + link.get_attribute("href"))
    assert response.ok and len(response.body()) > 0
    _shot(page, "trials")


def test_workers_timeline_has_bars(page: Any, site: Site) -> None:
    site.finished()
    _open(page, site, f"/study/{STUDY}/workers")
    assert page.locator("g.batch").count() > 0
    assert page.locator("#workers-table tbody tr[data-worker]").count() >= 1
    _shot(page, "workers")
    page.hover("g.batch >> nth=0")
    assert "node #" in page.inner_text("#tooltip")


def test_a_fresh_start_is_drawn_as_building_not_loading(page: Any, site: Site) -> None:
    """The first batch starts a fresh model at step 0: it loaded no checkpoint, and the
    timeline says it built the trainer (before: "loading a checkpoint", hatched)."""
    site.finished()
    _open(page, site, f"/study/{STUDY}/workers")
    fresh = page.locator("g.batch[data-start='0']")
    assert fresh.count() >= 1
    assert fresh.locator("rect.load").count() == 0
    page.hover("g.batch[data-start='0'] >> nth=0")
    tip = page.inner_text("#tooltip")
    assert "fresh trainer built in" in tip and "checkpoint load" not in tip
    assert "building a fresh trainer" in page.inner_text(".legend")


def test_unknown_study_says_so(page: Any, site: Site) -> None:
    _open(page, site, "/study/no-such-study")
    message = page.inner_text("#not-found")
    assert "No study named" in message and "no study 'no-such-study'" in message
    _shot(page, "not-found")

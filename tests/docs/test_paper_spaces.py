"""The Hippo paper's spaces (benchmarks/paper_spaces.py) match its Table 1."""

from __future__ import annotations

import pytest
from bench_module import bench_module

ps = bench_module("paper_spaces")


@pytest.mark.parametrize(
    ("study", "make", "steps"),
    [
        ("ResNet-56", ps.resnet56_space, ps.EPOCHS),
        ("MobileNetV2", ps.mobilenetv2_space, ps.EPOCHS),
        ("BERT-Base", ps.bert_space, ps.BERT_UNITS),
    ],
)
def test_space_matches_table_1(study, make, steps):
    trials, paper_rate = ps.PAPER_MERGE_RATES[study]
    space = make()
    assert len(space) == trials
    rate = ps.whole_space_merge_rate(space, steps)
    assert abs(rate - paper_rate) / paper_rate < 0.01, (study, rate, paper_rate)


def test_treeml_space_matches_the_thesis():
    space = ps.treeml_space()
    rate = ps.whole_space_merge_rate(space, ps.EPOCHS)
    assert abs(rate - ps.TREEML_MERGE_RATE) / ps.TREEML_MERGE_RATE < 0.01, rate


def test_fixed_values_split_plan_trees():
    # Two roots with the same sequences share nothing: p is the one-root p.
    space = ps.bert_space()
    one = list(space)
    other = [ps.TrialSpec({"model": "bert-large"}, dict(t.hp)) for t in one]
    rate = ps.whole_space_merge_rate(one + other, ps.BERT_UNITS)
    assert rate == pytest.approx(ps.whole_space_merge_rate(one, ps.BERT_UNITS))


def test_resnet20_studies_draw_144_each():
    space = ps.resnet20_space()
    assert len(space) == 288
    drawn = [space.trials(144, seed) for seed in range(2)]
    assert all(len(d) == 144 for d in drawn)
    assert set(drawn[0]) != set(drawn[1])

"""Paired comparisons (evals.paired): the bootstrap interval and the flip counts, on hand-made items."""
import math

import numpy as np
import pytest

from evals.paired import mark, paired


def test_flips_count_the_items_each_side_gets_alone():
    teacher = [1, 1, 1, 0, 0, 1, 0, 1]
    preset = [1, 0, 0, 0, 1, 1, 0, 1]
    r = paired(teacher, preset, n_boot=2000)
    assert (r["teacher_only"], r["preset_only"]) == (2, 1)
    assert r["n"] == 8 and r["teacher"] == 5 / 8 and r["preset"] == 4 / 8
    assert r["diff"] == pytest.approx(-1 / 8)


def test_identical_answers_are_no_difference():
    a = [1, 0, 1, 1, 0] * 20
    r = paired(a, a)
    assert r["diff"] == 0 and r["ci"] == [0.0, 0.0] and not r["significant"]
    assert (r["teacher_only"], r["preset_only"]) == (0, 0) and r["items_needed"] is None


def test_interval_matches_the_normal_approximation_on_many_items():
    rng = np.random.default_rng(1)
    teacher = (rng.random(2000) < 0.7).astype(int)
    preset = teacher.copy()
    flip = rng.choice(2000, 160, replace=False)
    preset[flip[:120]] = 0                                  # 120 items lost (some were wrong already)
    preset[flip[120:]] = 1
    r = paired(teacher, preset, n_boot=4000)
    d = preset - teacher
    half = 1.96 * d.std(ddof=1) / math.sqrt(d.size)
    assert r["ci"][0] == pytest.approx(d.mean() - half, abs=0.004)
    assert r["ci"][1] == pytest.approx(d.mean() + half, abs=0.004)
    assert r["ci"][0] < r["diff"] < r["ci"][1]


def test_pairing_sees_a_small_consistent_cost_that_independent_errors_miss():
    teacher = np.array([1] * 300 + [0] * 200)
    preset = teacher.copy()
    preset[:12] = 0                                         # 12 flips, all against the preset: 0.600 -> 0.576
    r = paired(teacher, preset)
    se = lambda x: math.sqrt(x.mean() * (1 - x.mean()) / x.size)
    assert abs(r["diff"]) < 1.96 * math.hypot(se(teacher), se(preset))     # unpaired: not significant
    assert r["significant"] and r["ci"][1] < 0                              # paired: it is
    assert (r["teacher_only"], r["preset_only"]) == (12, 0)
    assert "*" in mark(r) and mark(r).endswith(" 12/0")


def test_few_flips_are_not_significant_even_when_the_bootstrap_interval_excludes_zero():
    teacher = np.array([1] * 100 + [0] * 100)
    preset = teacher.copy()
    preset[:4] = 0                                          # 4 flips, all one way: sign test p = 2 / 16
    r = paired(teacher, preset)
    assert r["ci"][1] < 0 and r["p_flips"] == 0.125 and not r["significant"]
    preset[4:6] = 0                                         # 6 flips: p = 2 / 64
    r = paired(teacher, preset)
    assert r["p_flips"] == 2 / 64 and r["significant"]


def test_sign_test_is_the_exact_binomial():
    from math import comb

    from evals.paired import sign_test
    assert sign_test(0, 0) == 1.0 and sign_test(3, 3) == 1.0
    assert sign_test(9, 2) == pytest.approx(2 * sum(comb(11, k) for k in range(3)) / 2 ** 11)
    assert sign_test(2, 9) == sign_test(9, 2)


def test_items_needed_grows_as_the_difference_shrinks():
    base = np.array([1, 0] * 100)
    one_way = base.copy()
    one_way[[0, 2, 4, 6]] = 0                               # 4 lost
    mixed = one_way.copy()
    mixed[[1, 3]] = 1                                       # and 2 won back
    a, b = paired(base, one_way), paired(base, mixed)
    assert not b["significant"]
    assert b["items_needed"] > a["items_needed"] > 0
    d = mixed - base                                        # (z * sd / mean)^2
    assert b["items_needed"] == math.ceil((1.959963984540054 * d.std(ddof=1) / abs(d.mean())) ** 2)


def test_continuous_scores_have_no_flips():
    r = paired([-1.0, -2.0, -3.0], [-1.5, -2.5, -3.5])
    assert r["diff"] == pytest.approx(-0.5) and r["teacher_only"] is None and r["significant"]


def test_unequal_lengths_are_an_error():
    with pytest.raises(ValueError, match="equal-length"):
        paired([1, 0], [1])

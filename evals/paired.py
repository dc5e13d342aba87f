"""Paired comparison of a preset with the teacher on the same items.

Both answer every item, so the question is the mean of the per-item differences (preset - teacher), not two
accuracies with independent standard errors. The interval is a percentile bootstrap over items (resampling
the pairs); the flips are the items on which the two disagree, which is all the difference is made of.
With right/wrong scores and few flips the bootstrap interval is too narrow (4 flips all one way exclude 0 in
it), so there a difference is significant only if the exact sign test on the flips (McNemar's exact test)
agrees: p < 0.05 needs at least 6 flips, all one way.
"""
from __future__ import annotations

import math

import numpy as np

Z95 = 1.959963984540054


def paired(teacher, preset, n_boot: int = 10000, level: float = 0.95, seed: int = 0) -> dict:
    """teacher, preset: per-item scores of the same items in the same order (0/1 correctness, or any number).

    Returns the two means, diff = mean(preset - teacher) with its bootstrap interval `ci`, `significant`
    (the interval excludes 0, and for 0/1 scores the flips' exact sign test `p_flips` < 1 - level too), the flips
    (`teacher_only`: the teacher right and the preset wrong, `preset_only`: the reverse; for 0/1 scores), and
    `items_needed`: about how many items a 95% interval would need to
    exclude 0 if the per-item differences kept their mean and spread (None when the mean difference is 0).
    """
    t = np.asarray(teacher, dtype=np.float64)
    p = np.asarray(preset, dtype=np.float64)
    if t.shape != p.shape or t.ndim != 1:
        raise ValueError(f"paired scores must be two equal-length lists (got {t.shape} and {p.shape})")
    n = t.size
    d = p - t
    out = {"n": int(n), "teacher": float(t.mean()) if n else None, "preset": float(p.mean()) if n else None,
           "diff": float(d.mean()) if n else None, "ci": None, "level": level, "significant": False,
           "teacher_only": None, "preset_only": None, "p_flips": None, "items_needed": None}
    if n == 0:
        return out
    binary = bool(np.isin(t, (0, 1)).all() and np.isin(p, (0, 1)).all())
    if binary:
        out["teacher_only"] = int(((t == 1) & (p == 0)).sum())
        out["preset_only"] = int(((t == 0) & (p == 1)).sum())
        out["p_flips"] = sign_test(out["teacher_only"], out["preset_only"])
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    for s in range(0, n_boot, 1000):                      # chunks bound the index matrix at 1000 x n
        k = min(1000, n_boot - s)
        means[s:s + k] = d[rng.integers(0, n, size=(k, n))].mean(1)
    a = (1 - level) / 2
    lo, hi = np.quantile(means, [a, 1 - a])
    out["ci"] = [float(lo), float(hi)]
    out["significant"] = bool((lo > 0 or hi < 0) and (not binary or out["p_flips"] < 1 - level))
    mean, sd = float(d.mean()), float(d.std(ddof=1)) if n > 1 else 0.0
    if mean != 0 and sd > 0:
        out["items_needed"] = int(math.ceil((Z95 * sd / abs(mean)) ** 2))
    return out


def sign_test(a: int, b: int) -> float:
    """Two-sided exact binomial p-value of a flips one way and b the other (McNemar's exact test)."""
    n = a + b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(a, b) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def mark(r: dict) -> str:
    """'+0.012 [-0.004, +0.030]' with a * when significant, and the flips: the report's cell."""
    if not r or r.get("ci") is None:
        return "-"
    s = f"{r['diff']:+.3f} [{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}]{'*' if r['significant'] else ''}"
    if r.get("teacher_only") is not None:
        s += f" {r['teacher_only']}/{r['preset_only']}"
    return s

"""Published numbers the dashboard shows next to ours, each labelled with the paper's device.

Source: the LES paper's ablation for MiniCPM-V 4.7 LES on an iPhone (decode tok/s, one row per added
technique), as quoted in GitHub issue 7 of this project; check them against the paper before citing.
Our ladder (`python -m workbench ladder les --model demo --json`) adds the same techniques in the same order.
"""
from __future__ import annotations

LADDERS = {
    "les": {
        "paper": "LES",
        "model": "MiniCPM-V 4.7 LES",
        "device": "iPhone",
        "metric": "tok_s",
        "rungs": [
            ("on-demand", 3.38),
            ("+lookahead", 6.57),
            ("+scheduling & layout", 11.34),
            ("+mixed precision", 17.16),
            ("+speculative verification", 20.51),
        ],
    },
}

# Trade-offs that are not ladders: (setting, bytes, tok/s) points.
TRADEOFFS = {
    # The cache-window trade-off (as quoted in issue 8): a small window vs a large cache, same device.
    "les_cache": {
        "paper": "LES", "model": "MiniCPM-V 4.7 LES", "device": "iPhone", "metric": "tok_s vs memory",
        "points": [("small cache window", 3.0e9, 10.0), ("large cache", 7.8e9, 18.0)],
    },
}


def published(name: str) -> dict | None:
    """The paper's numbers for a ladder or a trade-off, or None."""
    return LADDERS.get(name) or TRADEOFFS.get(name)

"""The memory guard: what a model and a cache budget need in memory, what the machine (or its cgroup) has
available, and a refusal with both numbers before anything is loaded, instead of the OOM killer mid-run.

Needed: the non-expert weights as the engine holds them (f32) plus the expert cache, at most every expert (f32).
Available: /proc/meminfo's MemAvailable, capped by the cgroup's memory.max less its memory.current (Linux).
"""
from __future__ import annotations

import math
from pathlib import Path

from workbench.spec import WorkbenchError

MiB = 2 ** 20


def available_bytes() -> int | None:
    """Bytes this process can still take, or None where the system does not say (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    cg = Path("/sys/fs/cgroup")
    try:
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            avail = min(avail, int(limit) - int((cg / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return max(0, avail)


def model_bytes(spec, tensor_shapes) -> tuple[int, int]:
    """(non-expert weights, every expert), f32, as the numpy engine holds them in memory."""
    return (4 * sum(math.prod(s) for s in tensor_shapes),
            4 * 3 * spec.hidden_size * spec.moe_intermediate_size * spec.num_experts * len(spec.moe_layers))


def check_fits(dense: int, cache: int, all_experts: int, where: str, available: int | None = None):
    """Refuse a configuration that cannot fit, naming what it needs and what is available."""
    available = available_bytes() if available is None else available
    need = dense + min(cache, all_experts)
    if available is not None and need > available:
        raise WorkbenchError(f"{where}: needs {need / MiB:.0f} MiB of memory ({dense / MiB:.0f} MiB of weights + "
                             f"{min(cache, all_experts) / MiB:.0f} MiB of expert cache), {available / MiB:.0f} MiB "
                             f"available: choose a smaller --budget (largest that fits: "
                             f"{fits(dense, all_experts, available)['largest_budget']})")


def fits(dense: int, all_experts: int, available: int | None = None) -> dict:
    """What fits: the largest expert budget (a fraction of all experts, or "all") beside the weights."""
    available = available_bytes() if available is None else available
    out = {"available_bytes": available, "weights_bytes": dense, "all_experts_bytes": all_experts}
    if available is None:
        return {**out, "largest_budget": "unknown"}
    room = available - dense
    if room >= all_experts:
        largest = "all"
    elif room <= 0:
        largest = "none (the weights alone do not fit)"
    else:
        largest = f"{math.floor(100 * room / all_experts) / 100:.2f}"
    return {**out, "largest_budget": largest}

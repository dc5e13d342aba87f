"""The physical floor of a configuration (DESIGN.md's measurement protocol).

floor time per token = max(compute time per token, bytes read per token / disk bandwidth at the
read size and queue depth the run used), with the bandwidth from a disk probe of the pack's own disk, cached per
device (workbench.disk_probe.probe). The floor assumes reads overlap compute; a design that waits for all its
reads before computing (on_demand: wait-all, no prefetch) cannot beat the serial bound 1 / (compute + read),
reported beside it.
"""
from __future__ import annotations

from workbench.disk_probe import bandwidth_at


def read_size(pack) -> int:
    """The size of one read that brings in (part of) an expert in this pack's layout."""
    return max(n for _, n in pack.expert_reads(pack.spec.moe_layers[0], 0))


def floor_tok_s(pack, compute_s_per_token: float, bytes_per_token: float, disk: dict, size: int | None = None,
                depth: int | None = None) -> dict:
    """size: the mean bytes per read the run issued (default: the pack's read_size); depth: its reader threads."""
    size = size or read_size(pack)
    bw = bandwidth_at(disk, size, depth)
    read_s = bytes_per_token / bw
    floor = max(compute_s_per_token, read_s)
    serial = compute_s_per_token + read_s
    return {"floor_tok_s": 1.0 / floor if floor > 0 else float("inf"), "floor_read_s_per_token": read_s,
            "floor_compute_s_per_token": compute_s_per_token, "disk_bw_at_read_size": bw,
            "floor_read_size": size, "floor_queue_depth": depth,
            "serial_bound_tok_s": 1.0 / serial if serial > 0 else float("inf")}

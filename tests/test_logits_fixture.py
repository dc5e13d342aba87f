"""Refactors keep the numpy engine's numbers: every family and every preset gives, bit for bit, the logits
recorded in tests/fixtures/logits.npz (by tests/logits_fixture.py, before the refactor), on a machine like the one
that recorded them. On another CPU (other BLAS and SIMD kernels) the last decode row is held to 1e-4 instead."""
from __future__ import annotations

import numpy as np
import pytest

from logits_fixture import FIXTURE, digest, logits_of, machine, models, presets_for

OTHER_CPU_ATOL = 1e-4


@pytest.fixture(scope="module")
def recorded():
    with np.load(FIXTURE) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_models):
    return models(tmp_path_factory.mktemp("fixture-models"), tiny_models)


def test_fixture_covers_every_family_and_preset(recorded, checkpoints):
    assert "machine" in recorded
    want = {f"{m}/{p}/sha256" for m in checkpoints for p in presets_for(m)}
    assert want == {k for k in recorded if k.endswith("/sha256")}


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "dots1", "deepseek_v3", "deepseek_v2",
                                  "deepseek_v2+yarn", "deepseek_v3+yarn", "qwen3_moe+yarn", "demo"])
def test_logits_are_bit_identical_to_the_fixture(recorded, checkpoints, name):
    same_machine = str(recorded["machine"]) == machine()
    for preset in presets_for(name):
        lg = logits_of(checkpoints[name], preset)
        key = f"{name}/{preset}"
        off = float(np.abs(lg[-1] - recorded[key + "/last"]).max())
        if same_machine:
            assert digest(lg) == str(recorded[key + "/sha256"]), f"{key}: logits changed (last row max |diff| {off:g})"
        else:
            assert off <= OTHER_CPU_ATOL, f"{key}: logits changed (last row max |diff| {off:g}, recorded on " \
                                          f"{recorded['machine']}, this is {machine()})"

"""tests/child.py: a native crash in a child process fails one test, with the signal's name."""
from __future__ import annotations

import ctypes

import pytest

from child import in_child


def segfault():
    ctypes.string_at(0)


def test_a_native_crash_is_one_failed_test_with_its_signal():
    with pytest.raises(pytest.fail.Exception, match="segfault crashed its child process .signal SIGSEGV"):
        in_child(segfault)


def test_results_and_exceptions_come_back():
    assert in_child(divmod, 7, 2) == (3, 1)
    with pytest.raises(ZeroDivisionError):
        in_child(divmod, 1, 0)

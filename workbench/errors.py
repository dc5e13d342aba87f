"""Errors a user can fix."""
from __future__ import annotations


class WorkbenchError(Exception):
    """A user-facing error: one line naming the file and the problem (CLI exit code 2)."""

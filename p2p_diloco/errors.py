"""Errors a user can cause and fix, printed by the CLI as one line (``error: ...``, exit code 2).

This module imports nothing but the standard library, so that the bootstrap node and the CLI can
raise and catch these errors without loading torch or hivemind. ``ConfigError``, ``DataError`` and
``CheckpointError`` live beside the code that raises them and derive from :class:`UserError`.

Example::

    >>> try:
    ...     raise LearnerError("checkpoint dir runs/a is in use by another running learner")
    ... except UserError as e:
    ...     print(f"error: {e}")
    error: checkpoint dir runs/a is in use by another running learner
"""

from __future__ import annotations


class UserError(Exception):
    """Base of the errors a user can fix; the message is one line meant for the terminal."""


class LearnerError(UserError, RuntimeError):
    """A problem the user can fix (bad address, busy checkpoint dir, incompatible checkpoint)."""

"""Failures the user fixes from the message alone: bad input records, corrupted or mismatched
caches and checkpoints, wrong configs.  Every message names the file, line or key.

The command line prints such an error as one line, ``deepspec <command>: <kind>: <message>``,
and exits with ``exit_code``; the traceback only with ``--debug`` or ``DEEPSPEC_DEBUG=1``.
Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations


class DeepSpecError(Exception):
    """A known failure of a run: its data, files or environment (exit status 1)."""

    exit_code = 1


class UsageError(DeepSpecError):
    """A command line or config the program cannot run as given (exit status 2)."""

    exit_code = 2

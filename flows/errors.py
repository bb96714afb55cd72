"""Errors the command line prints as one line (exit 2) instead of a traceback."""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input; printed as one line."""

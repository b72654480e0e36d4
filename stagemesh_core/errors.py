"""The base class of errors that mean "the user asked for something that cannot work".

Each says what to change (a flag, a file, a variable). The CLI prints any
``UserError`` as one line and exits 2 instead of showing a traceback; anything
else is a bug and keeps its traceback. It subclasses ``ValueError`` because
every such error is a bad value, and callers that catch ``ValueError`` keep
working.
"""

from __future__ import annotations


class UserError(ValueError):
    """A request, flag or file the user must change; the message names it."""

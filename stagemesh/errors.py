"""Errors that mean "the user asked for something that cannot work", each saying what to change.

The CLI prints these as one line and exits 2 instead of showing a traceback;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from coordinator.layer_split import LayerSplitError
from coordinator.ports import PortRangeError
from stage_worker.model_spec import ModelFormatError

USER_ERRORS: tuple[type[Exception], ...] = (LayerSplitError, PortRangeError, ModelFormatError)

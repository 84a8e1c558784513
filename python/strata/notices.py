"""The engine's warnings: each message said once, through Python's `warnings` (StrataWarning),
on rank 0 only, and kept (engine.warnings) on every rank. The engine's parts are handed its
Notices and warn through it; nothing is printed.

Thread safety: the engine's (one thread).
"""

import warnings

__all__ = ["Notices", "StrataWarning"]


class StrataWarning(UserWarning):
    """What the engine warns of: a key it does not act on, a value it changed, a plan it left."""


class Notices:
    """One engine's warnings (see the module's docstring). `say`: whether this rank says them."""

    def __init__(self, say=True):
        self.messages = []
        self.say = say

    def warn(self, message):
        if message not in self.messages:
            self.messages.append(message)
            if self.say:  # every rank keeps it; rank 0 says it
                warnings.warn(f"strata: {message}", StrataWarning, stacklevel=3)

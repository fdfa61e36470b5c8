"""The errors of a tool grammar: one llguidance cannot compile, and one over its cost limits."""

from __future__ import annotations


class GrammarError(ValueError):
    """A grammar llguidance could not compile (the message carries llguidance's reason).

    Attributes:
        path: the JSON path of the schema keyword found at fault
            (``tools[0].function.parameters.properties.x.minimum``), or None.
    """

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class GrammarLimitError(GrammarError):
    """A tool grammar that exceeded one of :class:`GrammarLimits` (compile time, or the deadline of
    one token's mask computation)."""

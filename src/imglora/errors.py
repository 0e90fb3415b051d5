"""User-facing errors.

Anything a user can cause (a bad preset, a broken image, a missing model) raises a subclass of
``ImgloraError``. The CLI prints its message, without a traceback, and exits with ``exit_code``.
"""

from __future__ import annotations


class ImgloraError(Exception):
    """An error the user can fix; the message says what is wrong and what to do."""

    exit_code = 1


class ConfigError(ImgloraError):
    """The preset or its overrides are invalid. Raised before any model is loaded."""

    exit_code = 2

    def __init__(self, problems: list[str], source: str = ""):
        self.problems = list(problems)
        n = len(self.problems)
        where = f" {source}" if source else ""
        head = f"{n} problem{'s' if n != 1 else ''} in the configuration{where}:"
        super().__init__("\n".join([head, *(f"  - {p}" for p in self.problems)]))


class DataError(ImgloraError):
    """The dataset holds files that cannot be used."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        n = len(self.problems)
        head = f"{n} problem{'s' if n != 1 else ''} in the dataset:"
        super().__init__("\n".join([head, *(f"  - {p}" for p in self.problems)]))


class ModelSourceError(ImgloraError):
    """``model.path`` cannot be resolved to a model folder on this machine."""

"""The one error a recipe raises when it is built wrong."""
from __future__ import annotations


class RecipeError(ValueError):
    """A recipe mistake, in one line: what is wrong and how to fix it (raised when the recipe is built)."""


class RecipeWarning(UserWarning):
    """A recipe that builds, but likely not as meant (e.g. hyperparameters that make one method another)."""

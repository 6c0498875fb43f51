"""``load_recipe("path/file.py:NAME")``: a recipe defined in a Python file (the CLI's ``--recipe``, the
coordinator's recipe directory, ``fl-server export``). The file is code: it is run, so only an operator's or
the user's own files are ever named; nothing received over the network reaches this function.

>>> from fl_server.recipes import load_recipe
>>> recipe = load_recipe("my_recipes.py:small")  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import sys
from pathlib import Path

from fl_server.recipes.errors import RecipeError


def split_source(source: str) -> tuple[Path, str]:
    """``"file.py[:NAME]"`` -> (path, NAME); NAME defaults to ``recipe``."""
    path, sep, name = str(source).rpartition(":")
    if not sep or not path.endswith(".py") or "/" in name or not name.isidentifier():
        path, name = str(source), "recipe"
    return Path(path), name


def load_recipe(source: str | Path):  # -> Recipe (annotated loosely: recipe.py imports nothing from here)
    """The ``Recipe`` object named ``NAME`` (default ``recipe``) in the Python file ``path``; also accepts a
    callable ``NAME()`` returning one. The recipe remembers ``source`` (absolute path) for its runs' run.json."""
    from fl_server.recipes.recipe import Recipe

    path, name = split_source(str(source))
    if path.suffix != ".py":
        raise RecipeError(f"recipe source must be a Python file FILE.py[:NAME], got {source}")
    if not path.is_file():
        raise RecipeError(f"recipe file {path} not found")
    path = path.resolve()
    module_name = f"_fl_recipe_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RecipeError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling-free introspection want the module registered
    try:
        spec.loader.exec_module(module)
    except RecipeError as exc:
        raise RecipeError(f"{path}: {exc}") from None
    if not hasattr(module, name):
        found = [k for k, v in vars(module).items() if isinstance(v, Recipe)]
        raise RecipeError(f"{path} defines no {name!r}; recipes in it: {', '.join(found) or 'none'} "
                          f"(name one as {path.name}:NAME)")
    recipe = getattr(module, name)
    if callable(recipe) and not isinstance(recipe, Recipe):
        recipe = recipe()
    if not isinstance(recipe, Recipe):
        raise RecipeError(f"{path}:{name} is a {type(recipe).__name__}, not a Recipe")
    return dataclasses.replace(recipe, source=f"{path}:{name}", name=recipe.name or name)


RECIPE_NAME = r"^[A-Za-z0-9_-]{1,64}(:[A-Za-z_][A-Za-z0-9_]{0,63})?$"  # FILE[:NAME] in a recipe directory


def resolve_in_dir(directory: str | Path | None, name: str) -> str:
    """``"FILE[:NAME]"`` -> ``"<directory>/FILE.py:NAME"``: a recipe an admin names from the directory the
    operator configured (``FL_SERVE_RECIPES_DIR``); no path, only a file name, so nothing outside it is reached."""
    import re

    if directory is None:
        raise RecipeError("this coordinator has no recipe directory; its operator sets FL_SERVE_RECIPES_DIR")
    if not re.match(RECIPE_NAME, name):
        raise RecipeError(f"recipe names are FILE or FILE:NAME (letters, digits, _ and -), got {name!r}")
    file, _, attr = name.partition(":")
    path = Path(directory) / f"{file}.py"
    if not path.is_file():
        raise RecipeError(f"no recipe file {file}.py in the coordinator's recipe directory")
    return f"{path.resolve()}:{attr or 'recipe'}"

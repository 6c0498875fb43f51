"""``load_recipe("path/file.py:NAME")``: a recipe defined in a Python file (the CLI's ``--recipe``, the
coordinator's recipe directory, ``fl-server export``); ``import_plugin``: a file or module that registers a
method, its device step's graph builder or anything else at import (the coordinator's ``FL_SERVE_PLUGINS``).
The file is code: it is run, so only an operator's or the user's own files are ever named; nothing received
over the network reaches these functions.

>>> from fl_server.recipes import load_recipe
>>> recipe = load_recipe("my_recipes.py:small")  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from fl_server.recipes.errors import RecipeError


def split_source(source: str) -> tuple[Path, str]:
    """``"file.py[:NAME]"`` -> (path, NAME); NAME defaults to ``recipe``."""
    path, sep, name = str(source).rpartition(":")
    if not sep or not path.endswith(".py") or "/" in name or not name.isidentifier():
        path, name = str(source), "recipe"
    return Path(path), name


def import_file(path: str | Path) -> ModuleType:
    """Run the Python file ``path`` as a module, once per process for the same bytes (a file loaded again
    unchanged, e.g. by the training and then by the export of one run, is not run twice: the methods it
    registers stay the same classes). Its folder goes on ``sys.path``, as ``python file.py`` puts it, so that it
    can import the modules beside it (a model kept in its own ``models.py``). Raises :class:`RecipeError` for a
    missing file."""
    path = Path(path)
    if path.suffix != ".py" or not path.is_file():
        raise RecipeError(f"{path}: no such Python file")
    path = path.resolve()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    module_name = f"_fl_recipe_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    known = sys.modules.get(module_name)
    if known is not None and getattr(known, "__fl_digest__", None) == digest:
        return known
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RecipeError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    module.__fl_digest__ = digest  # type: ignore[attr-defined]
    sys.modules[module_name] = module  # dataclasses and pickling-free introspection want the module registered
    if str(path.parent) not in sys.path:  # as `python file.py` runs it: the modules beside it import
        sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except RecipeError as exc:
        del sys.modules[module_name]
        raise RecipeError(f"{path}: {exc}") from None
    except Exception as exc:  # the user's code failed: where, in one line (python FILE.py shows the traceback)
        del sys.modules[module_name]
        raise RecipeError(f"{_where(exc, path)}: {type(exc).__name__}: {_message(exc)}; python {path.name} shows "
                          f"the whole traceback") from None
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _where(exc: Exception, path: Path) -> str:
    """``FILE line N``: the last place in ``path``'s folder (the recipe file or a module beside it) that ``exc``
    passed through, or where a syntax error is."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename} line {exc.lineno}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).parent == path.parent]
    return f"{frames[-1].filename} line {frames[-1].lineno}" if frames else str(path)


def _message(exc: Exception) -> str:
    """``exc``'s message on one line."""
    text = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    return " ".join(text.split()) or "(no message)"


def import_plugin(entry: str) -> ModuleType:
    """A plugin: ``path/file.py`` (:func:`import_file`) or an installed module's dotted name; importing it
    registers what it defines (``@register`` methods, ``@register_step_graph`` builders).

    >>> import_plugin("plugins/my_method.py")  # doctest: +SKIP
    """
    if entry.endswith(".py"):
        return import_file(entry)
    if not all(part.isidentifier() for part in entry.split(".")):
        raise RecipeError(f"a plugin is a file path ending in .py or a module name (a.b.c), got {entry!r}")
    try:
        return importlib.import_module(entry)
    except ModuleNotFoundError as exc:
        raise RecipeError(f"plugin module {entry!r} cannot be imported ({exc}); install it or name its .py file") \
            from None


def recipe_factory(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Register a function of a recipe file as a recipe: a coordinator's job may name it (``FILE:NAME``) and it is
    called with no arguments to build the ``Recipe``. A job names nothing else but a ``Recipe`` object.

    >>> @recipe_factory  # doctest: +SKIP
    ... def small() -> Recipe: return Recipe(model="mlp", data=DataSpec.builtin("digits"), method="TENT")
    """
    fn.__fl_recipe_factory__ = True  # type: ignore[attr-defined]
    return fn


def load_recipe(source: str | Path, registered_only: bool = False):  # -> Recipe (recipe.py imports nothing here)
    """The ``Recipe`` object named ``NAME`` (default ``recipe``) in the Python file ``path``; also accepts a
    callable ``NAME()`` returning one (with ``registered_only``, a coordinator's job: only one decorated with
    :func:`recipe_factory`; any other function is refused, not called). The recipe remembers ``source``
    (absolute path) for its runs' run.json."""
    from fl_server.recipes.recipe import Recipe

    path, name = split_source(str(source))
    if path.suffix != ".py":
        raise RecipeError(f"recipe source must be a Python file FILE.py[:NAME], got {source}")
    if not path.is_file():
        raise RecipeError(f"recipe file {path} not found")
    path = path.resolve()
    module = import_file(path)
    if not hasattr(module, name):
        found = [k for k, v in vars(module).items() if isinstance(v, Recipe)]
        raise RecipeError(f"{path} defines no {name!r}; recipes in it: {', '.join(found) or 'none'} "
                          f"(name one as {path.name}:NAME)")
    recipe = getattr(module, name)
    if callable(recipe) and not isinstance(recipe, Recipe):
        if registered_only and not getattr(recipe, "__fl_recipe_factory__", False):
            raise RecipeError(f"{path.name}:{name} is a {type(recipe).__name__}, not a Recipe nor a function "
                              "registered with @recipe_factory; a job names only those")
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
    root = Path(directory).resolve()
    path = root / f"{file}.py"
    if not path.is_file():
        raise RecipeError(f"no recipe file {file}.py in the coordinator's recipe directory")
    if path.resolve().parent != root:  # a link to a file elsewhere is not the operator's recipe
        raise RecipeError(f"recipe file {file}.py links out of the coordinator's recipe directory; copy the file in")
    return f"{path.resolve()}:{attr or 'recipe'}"

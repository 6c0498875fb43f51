"""Recipes: the public way to train on your own model and data, between the methods/engine and their consumers
(the CLI, the coordinator's jobs, the exporter and the bench harness).

>>> import numpy as np
>>> from fl_server.recipes import DataSpec, Federation, Recipe, train
>>> x = (np.random.default_rng(0).random((200, 8, 8, 1)) * 255).astype(np.uint8)
>>> y = np.arange(200) % 4
>>> recipe = Recipe(model="mlp", data=DataSpec.from_arrays(x, y, layout="NHWC"),
...                 federation=Federation(partition="iid", num_clients=10), method="FedTTA", rounds=5)
>>> record = train(recipe, "runs/example")  # doctest: +SKIP
"""
from edge_sdk import Preprocess
from fl_server.recipes.data import DataSpec
from fl_server.recipes.errors import RecipeError
from fl_server.recipes.loader import load_recipe, recipe_factory
from fl_server.recipes.model import ModelSpec
from fl_server.recipes.recipe import Federation, Recipe
from fl_server.recipes.run import federate, train

__all__ = ["DataSpec", "Federation", "ModelSpec", "Preprocess", "Recipe", "RecipeError", "federate", "load_recipe",
           "recipe_factory", "train"]

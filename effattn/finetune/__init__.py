"""Healing fine-tunes: typed recipes, the accelerate loop that runs them, and built-in recipes.

    from effattn.finetune import load_recipe, finetune
    result = finetune(load_recipe("heal-gqa", ["train.max_steps=50"], output="out/healed"))
"""

from .config import Recipe, apply_overrides, load_recipe, validate_recipe
from .loop import FinetuneResult, finetune
from .plan import plan_finetune
from .recipes import builtin_recipes, copy_recipe, recipe_path

__all__ = ["Recipe", "FinetuneResult", "apply_overrides", "builtin_recipes", "copy_recipe", "finetune",
           "load_recipe", "plan_finetune", "recipe_path", "validate_recipe"]

"""Built-in recipes: the YAML files shipped in `effattn/recipes/`, addressed by name."""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

from ..errors import EffattnError, one_of


def builtin_recipes() -> dict[str, Path]:
    """name -> path of every built-in recipe (`heal-gqa` is effattn/recipes/heal-gqa.yaml)."""
    folder = resources.files("effattn.recipes")
    return {Path(p.name).stem: Path(str(p)) for p in sorted(folder.iterdir(), key=lambda p: p.name)
            if p.name.endswith(".yaml")}


def recipe_path(name_or_file: str) -> Path:
    """A recipe file as given, else the built-in recipe of that name."""
    path = Path(name_or_file).expanduser()
    if path.is_file():
        return path
    recipes = builtin_recipes()
    if name_or_file in recipes:
        return recipes[name_or_file]
    raise EffattnError(f"recipe {name_or_file!r} is neither a file nor a built-in recipe", one_of(name_or_file, recipes))


def copy_recipe(name: str, dest: str | Path, *, force: bool = False) -> Path:
    """Copy built-in recipe `name` to `dest` (a file, or a folder to put NAME.yaml in)."""
    recipes = builtin_recipes()
    if name not in recipes:
        raise EffattnError(f"unknown built-in recipe {name!r}", one_of(name, recipes))
    if not str(dest).strip():
        raise EffattnError("the destination is empty (it would mean the current folder)",
                           f"name a file or folder, e.g. {name}.yaml or ./")
    folder = str(dest).endswith(("/", "\\"))  # `recipes cp heal-gqa recipes/`: a folder, made if need be
    dest = Path(dest).expanduser()
    if dest.is_dir() or folder:
        dest = dest / f"{name}.yaml"
    if dest.exists() and not force:
        raise EffattnError(f"{dest} already exists", "pass --force to overwrite it, or choose another file")
    blocker = next((p for p in [dest.parent, *dest.parent.parents] if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise EffattnError(f"cannot write {dest}: {blocker} is a file, not a folder", "choose another path")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(recipes[name], dest)
    except OSError as exc:
        raise EffattnError(f"cannot write {dest} ({exc.strerror or exc})", "choose a path you can write to") from None
    return dest

"""effattn's own model classes, as a registry: one ModelSpec per `model_type` no native architecture covers.

A conversion whose result no `transformers` architecture can express declares a ModelSpec (its
`model` attribute): the config and model classes, the modules to bundle into a self-contained
`modeling_*.py` written beside the weights (so the folder loads with `trust_remote_code=True`
without effattn), and a description. `import effattn` registers every declared spec with
`AutoConfig`/`AutoModelForCausalLM`; the conversion driver, the fine-tune's export, the model cards
and `families.family_for` read this registry, so none of them names a model type.

Every effattn model keeps its base model's `model_type` in `config.base_model_type`, so its layout
(families.py) is the base family's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True)
class ModelSpec:
    model_type: str  # config.json's model_type
    description: str
    config_class: Callable[[], type]  # returns the PretrainedConfig subclass (imported lazily)
    model_class: Callable[[], type]  # returns the *ForCausalLM class
    modeling_file: str  # e.g. "modeling_effattn_vq.py", named by config.json's auto_map
    modules: tuple[str, ...]  # effattn modules (paths under effattn/) bundled into it, in dependency order
    # bytes one decoder layer keeps for the backward pass beyond what a softmax layer keeps, for a batch of
    # B sequences of T tokens: layer_activation_bytes(config, B, T) (the fine-tune's memory plan); None: none
    layer_activation_bytes: Callable[[dict, int, int], int] | None = None
    # FLOPs per token one decoder layer's training step (forward and backward) costs beyond what the fine-tune's time
    # plan counts for a softmax layer, for sequences of T tokens: layer_train_flops(config, T); None: none
    layer_train_flops: Callable[[dict, int], float] | None = None
    # how a padded batch (prompts of different lengths, as generate() pads them) runs: "rows" (WrappedCausalLM.
    # forward_rows: each row's tokens alone, with the row's own cache) or "batched" (the attention takes each row's
    # padding in front; padding between tokens is refused)
    padding: str = "rows"

    def bundle(self) -> str:
        """The modules as one self-contained Python module (effattn's own imports dropped)."""
        header = [f'"""{self.description}: model code written by effattn (https://pypi.org/project/effattn), '
                  "bundled from its",
                  "modules " + ", ".join(f"effattn/{p}" for p in self.modules) + ".",
                  'Loaded by transformers with trust_remote_code=True; `import effattn` registers the same classes."""',
                  ""]
        imports, bodies, aliases = [], [], []
        for rel in self.modules:
            text = (ROOT / rel).read_text()
            text = re.sub(r'\A\s*(?:"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\')\s*\n', "", text)  # module docstring
            body = []
            for line in text.splitlines():
                if line.startswith(("from effattn", "import effattn", "from ..", "from __future__")):
                    # the names come from the bundled modules themselves; a renamed one keeps its new name
                    renamed = re.findall(r"(\w+) as (\w+)", line.split(" import ")[-1])
                    aliases += [f"{new} = {old}" for old, new in renamed]
                    continue
                if line.startswith(("import ", "from ")):
                    if line not in imports:
                        imports.append(line)
                    continue
                body.append(line)
            bodies.append(f"# ---- effattn/{rel} " + "-" * max(0, 80 - len(rel)) + "\n" + "\n".join(body).strip() + "\n")
        tail = ["", "", "# names the modules import under another name", *aliases] if aliases else []
        return "\n".join(header + imports + ["", ""] + ["\n\n".join(bodies)] + tail)

    def write_code(self, folder: Path) -> None:
        (Path(folder) / self.modeling_file).write_text(self.bundle())


MODEL_SPECS: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> None:
    """Add `spec` to the registry and make transformers' Auto classes load it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    MODEL_SPECS[spec.model_type] = spec
    config_class = spec.config_class()
    try:
        AutoConfig.register(spec.model_type, config_class)
        AutoModelForCausalLM.register(config_class, spec.model_class())
    except ValueError:  # already registered (a reload)
        pass


def model_spec(model_type: str | None) -> ModelSpec | None:
    return MODEL_SPECS.get(model_type) if model_type else None


def export_code_for(model: Any) -> Callable[[Any, Path], None] | None:
    """`save_model`'s export hook: writes the modeling code of an effattn model (None for native ones)."""
    spec = model_spec(getattr(model.config, "model_type", None))
    return None if spec is None else (lambda _model, folder: spec.write_code(folder))


def register_all() -> None:
    """Register the model class of every conversion that declares one (called by `import effattn`;
    importing the conversion registry registers them)."""
    from . import convert  # noqa: F401

"""effattn: attention surgery on pretrained LLMs."""

import os

# MKL may otherwise run a product on fewer threads than torch asks for when the machine is busy, and a
# different split rounds differently: a conversion or a resumed fine-tune would then depend on the
# load. Set before torch loads MKL; a user's own MKL_DYNAMIC wins.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

__version__ = "0.1.0"


def _register_models() -> None:
    """`AutoModelForCausalLM.from_pretrained` loads effattn's converted models after `import effattn`:
    every conversion's model class (models.py) is registered."""
    try:
        from .models import register_all
    except ImportError:  # transformers missing: the rest of effattn reports it where it is needed
        return
    register_all()


_register_models()

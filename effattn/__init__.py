"""effattn: attention surgery on pretrained LLMs."""

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

"""effattn: attention surgery on pretrained LLMs."""

__version__ = "0.1.0"


def _register_models() -> None:
    """`AutoModelForCausalLM.from_pretrained` loads effattn's converted models after `import effattn`."""
    try:
        from .attention.vq import register
    except ImportError:  # transformers missing: the rest of effattn reports it where it is needed
        return
    register()


_register_models()

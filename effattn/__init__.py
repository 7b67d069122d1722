"""effattn: attention surgery on pretrained LLMs."""

__version__ = "0.1.0"

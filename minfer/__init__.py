"""minfer: a small, fast decoder-only LLM inference engine."""
__version__ = "0.1.0"

"""minfer: a small, fast decoder-only LLM inference engine."""
__version__ = "0.1.0"


def __getattr__(name):
    # LLM, SamplingParams and StructuredOutputs on first use, so that `import minfer` stays cheap (no torch import)
    if name == "LLM":
        from .llm import LLM
        return LLM
    if name == "SamplingParams":
        from .sampling import SamplingParams
        return SamplingParams
    if name == "StructuredOutputs":
        from .structured import StructuredOutputs
        return StructuredOutputs
    raise AttributeError(f"module 'minfer' has no attribute {name!r}")

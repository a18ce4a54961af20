"""The engines: EngineCore (continuous batching over a paged KV cache, core.py) and the static-batch Engine
(a padded batch over a dense cache, static.py)."""
from .loaded import LoadedModel
from .static import Engine, Output
from .stats import Stats, format_details, format_stats, print_stats

__all__ = ["Engine", "LoadedModel", "Output", "Stats", "format_details", "format_stats", "print_stats"]

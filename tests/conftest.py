"""Tests marked `gpu` need a CUDA GPU and the built extension; they skip cleanly without them."""
import pytest
import torch


def _gpu_ready() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    try:
        import minfer._C  # noqa: F401
    except ImportError as e:
        return False, f"minfer._C not built ({e})"
    return True, ""


def pytest_collection_modifyitems(config, items):
    ready, why = _gpu_ready()
    if ready:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """Say how many GPU tests were skipped, so that a green run without a GPU is not read as GPU coverage."""
    ready, why = _gpu_ready()
    if ready:
        return
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "gpu" in getattr(r, "keywords", {})]
    if skipped:
        terminalreporter.write_line(f"GPU tests: {len(skipped)} skipped ({why}); they run on a GPU machine "
                                    f"(python -m pytest tests -m gpu, or .ci/gpu)")

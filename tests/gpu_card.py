"""What the GPU tests read off the card they run on, as the kernels' planners do (common/launch.h)."""
import torch


def thin_dram() -> bool:
    """Whether the card's DRAM gives an SM under 30 GB/s (the H100: 25; the H200: 36.5): common/launch.h's
    `thin_dram`, which picks the decode's shallow long streams and gemv's wide-rows ring."""
    props = torch.cuda.get_device_properties(0)  # memory clock in kHz, two transfers a clock (HBM)
    bytes_per_s = 2 * props.memory_clock_rate * 1e3 * (props.memory_bus_width // 8)
    return bytes_per_s / 1e9 / props.multi_processor_count < 30

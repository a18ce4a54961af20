// qlinear's kernels for Q4_1: a translation unit of their own, so that the formats compile in parallel.
#include "qgemm/qlinear_launch.cuh"

MINFER_QLINEAR_FORMAT(::minfer::qgemm::kQ4_1)

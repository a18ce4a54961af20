// qlinear's kernels for Q5_0: a translation unit of their own, so that the formats compile in parallel.
#include "qgemm/qlinear_launch.cuh"

MINFER_QLINEAR_FORMAT(::minfer::qgemm::kQ5_0)

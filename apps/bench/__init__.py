"""Benchmark helpers: common.py times a kernel Case; one module per kernel family defines CASES: {kernel name:
Case}; workload.py draws the requests of bench_throughput.py and bench_serve.py."""

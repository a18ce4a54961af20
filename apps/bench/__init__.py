"""Benchmark cases, one module per kernel family. Each module defines CASES: {kernel name: Case}."""

"""The benchmarks behind tools/benchmark.py, one module per job; common.py holds what they share."""

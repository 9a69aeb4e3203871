"""Pet's command-line tools (train_net.py, test_net.py, predict.py, export.py, benchmark.py, ...), each run as a
script. A package only so that tools.benchmarks can be imported from the repository root (pytest.ini's pythonpath)."""

"""What the test files share: helpers, the toy model and loaders, two-rank processes, tiny detectors, references,
and the plugin modules configs name by dotted path (``support.fault_plugins.CloseMarker``). tests/ is on ``sys.path``
(pytest.ini) and on the ``PYTHONPATH`` of every process the suite starts (tests/conftest.py)."""

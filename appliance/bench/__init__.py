"""Benchmarks (``appliance bench ...``): fixed suites run in real time, printing a table and writing JSON."""

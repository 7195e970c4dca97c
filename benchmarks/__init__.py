"""Benchmarks: ``python -m benchmarks`` regenerates the overview tables, ``python -m benchmarks NAME`` one other table (``--list``)."""

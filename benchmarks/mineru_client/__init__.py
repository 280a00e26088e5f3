"""MinerU's own client (mineru-vl-utils) through an overloaded gateway: `python -m
benchmarks.mineru_client --help`."""

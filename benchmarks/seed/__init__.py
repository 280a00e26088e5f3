"""The seed deployment's published benchmark, reproduced in shape with vLLM's own benchmark tool:
512-token prompts, 1024-token answers, 1, 8, 16 and 32 concurrent clients, QPS and TTFT, TPOT and
E2E latency at p50, p90 and p99 (docs/seed-deployment.md). The gateway over 4 simulated 910B
workers against vLLM's own data-parallel balancer (emulated) over the same workers, in the same
run; then, as a check, real vLLM on CPU (`--data-parallel-size 2` against the gateway over two
single servers, the tiny local model).

    python -m benchmarks.seed --quick     # a smoke run (about 3 minutes)
    python -m benchmarks.seed             # about 15 minutes: benchmarks/results/seed.{json,md,png}

Needs `make vllm` (vLLM's CPU build runs `vllm bench serve`; `driver.py` says how). See
`bench.py` for the method and `report.py` for the tables.
"""

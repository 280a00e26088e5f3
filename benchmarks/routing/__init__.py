"""Routing evidence for issue 3: queue-length routing against round-robin, own-count policies,
vLLM's own data-parallel balancer (emulated) and vllm-router, on simulated and real vLLM workers.

    python -m benchmarks.routing --quick          # ~5 minutes, a smoke run of the whole pipeline
    python -m benchmarks.routing                  # the full suite (results in benchmarks/results/)
    python -m benchmarks.routing --engine vllm    # small-scale check on real vLLM (CPU)

See `suite.py` for the method and README.md ("Routing evidence") for the results.
"""

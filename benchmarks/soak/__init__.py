"""The soak benchmark (issue 14): ten minutes of mixed MinerU-like load through one gateway in
front of simulated workers, with a fault injected on a schedule, and what it leaves behind.

    python -m benchmarks.soak --out benchmarks/results/soak.json    (make bench-soak)

- `load.py`: closed-loop clients (streamed and whole requests), and what each request got:
  completed, an explicit error (OpenAI-shaped JSON, or an SSE error event before [DONE]), or lost.
- `faults.py`: the faults, one per window: a worker killed (-9) and restarted, a worker frozen
  (SIGSTOP), a worker answering 503 to everything, garbage or streams cut short, one that never
  answers, one whose /metrics hangs (the last four join the gateway through its admin API for the
  window), slow readers, a burst of clients disconnecting at once, a thousand idle connections.
- `run.py`: the schedule, the gateway's RSS and descriptors at the start and end (both taken idle,
  the start after a warm-up), its counters, and the results; `report.py` writes the summary.
"""

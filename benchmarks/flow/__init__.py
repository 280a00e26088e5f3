"""The flow-control benchmark (issue 13): the gateway's own fair queue against pass-through.

Every scenario runs the gateway twice on the same workers and the same seeded requests, with
`--flow-control false` (pass-through: forward at once, today's behaviour and the baseline) and
`--flow-control true`, and reports its figures as ratios against what the baseline (or the
scenario's own reference, such as B alone or the fleet's capacity) measured in the same run.

    python -m benchmarks.flow --scenario flood --out benchmarks/results/flow_flood.json

Scenarios (`scenarios.py`): `flood` (one tenant's MinerU batch against another's interactive
streams), `sweep` (offered load 0.5x to 3x capacity), `single` (no cost for a single user),
`vllm` (real vLLM on CPU, two keys, one flooding).
"""

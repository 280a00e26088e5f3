"""What a fleet of W workers costs the gateway at rest and per request
(docs/operate/fleet-scale.md).

`python -m benchmarks.fleet --out benchmarks/results/fleet.json` (`make bench-fleet`).
"""

"""Several gateway replicas over the same workers (issue 15): two gateways, each sent every other
request (as a Kubernetes Service spreads connections), against one gateway taking all of it, on
the same 4 simulated workers and the same seeded requests.

    python -m benchmarks.replicas --quick        # a smoke run (~6 minutes)
    python -m benchmarks.replicas                # the results in benchmarks/results/replicas.*

It reuses the routing benchmark whole (`benchmarks/routing/`: the MinerU mix, the open-loop load,
the scenarios, the run protocol and its goodput); see `bench.py` for what it adds.
"""

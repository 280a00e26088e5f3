"""Coalescing and the result cache on the simulator (`make bench-cache`, docs/cache.md).

Small requests: the gateway's CPU and latency with the cache and coalescing off, coalescing alone
(the defaults), the memory cache and Redis, every request a miss, in the same run. A hit's
latency for a 2 MB page request, memory and Redis, against the worker's answer, and where the
gateway's part of it goes. A batch of pages sent twice; duplicates in a batch and 100 identical
requests at once. One Redis behind two replicas. The gateway's
RSS while 100,000 distinct answers go through the memory cache. MinerU's own client parsing the
same pages twice (benchmarks/mineru_client). Every server is its own process (`mineru-gateway
sim`, `mineru-gateway serve`, `redis-server`).

    python -m benchmarks.cache --out benchmarks/results/cache.json
"""

"""Coalescing and the result cache on the simulator (`make bench-cache`, docs/cache.md).

(a) a batch of pages sent twice: the second pass's worker requests and wall time against the
first's; (b) a batch with a fifth duplicates, and 100 identical requests at once: worker
requests against requests sent; (c) a cache hit's latency for a 2 MB page request, memory and
Redis, against the worker's answer; (d) small-request CPU of the gateway with the cache off and
with it on but every request a miss, in the same run. Every server is its own process
(`mineru-gateway sim`, `mineru-gateway serve`, `redis-server`).
"""

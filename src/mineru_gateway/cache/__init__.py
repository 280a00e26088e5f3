"""Never compute a page twice: identical requests in flight share one generation, and complete
answers of greedy requests are kept for the next identical request (docs/cache.md).

`keys` decides what is cacheable and its key (pure, used while the body is parsed); `answers`
holds what a finished generation left and how it is stored and replayed; `stores` keeps answers
(in process or in Redis); `flights` runs shared generations; `service` is the relay's hook.
"""

"""The stores' code: quant-cache's record layout in Redis, weight-sync's bulk data plane, and
the Redis plumbing both use (bulk values without copies, a local redis-server)."""

"""Embedding transfer out of Eric: the pool, its backends (Mooncake, NIXL, shm, HTTP), the consumer client."""

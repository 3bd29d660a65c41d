"""The Valkey tier: one server per shard. ``client`` (stripes, tickets and leases over batched commands and Lua),
``resp`` (the receive path that reads replies straight into caller-owned buffers) and ``servers`` (embedded
servers started on demand and shared through the runtime directory).
"""

"""The Valkey tier: one server per shard. ``client`` (stripes, tickets and leases over batched commands and Lua,
the scripts in ``scripts``), ``resp`` (the receive path that reads replies straight into caller-owned buffers) and
``pool`` (its connections, lent one per thread), and ``servers`` (embedded servers started on demand and shared
through the runtime directory: the record and its lock in ``records``, the processes in ``processes``).
"""

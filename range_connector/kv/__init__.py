"""Pure data of the storage format: the namespace and prefix hash chain, the KV layout, tickets, stripes, shard
plans and the metadata the two halves exchange.

Contract: no I/O, no threads, no clocks; everything here is a function of its arguments, so both halves (and tools
that read stored data) agree on it byte for byte. May import: ``errors`` (and torch, numpy, msgpack, blake3, xxhash).
"""

"""The file tier: one directory per shard holding stripe files, a ticket log and leases, with Range's own byte
budget and least-recently-used eviction (POSIX I/O; ``O_DIRECT`` where the file system supports it).
"""

"""The file tier: one directory per shard holding stripe files, a ticket log and leases, with Range's own byte
budget and least-recently-used eviction (POSIX I/O; ``O_DIRECT`` where the file system supports it).

``backend`` (:class:`~range_connector.backends.file.backend.FileBackend`, the tier's layout and guarantees),
``stripes`` (the stripe file format and its reads and writes), ``ticket_log`` (the tickets, replayed from an
append-only log), ``capacity`` (byte accounting, eviction and leases) and ``gds`` (whether kvikio's ``CuFile`` reads
into device memory here: the start-up probe).
"""

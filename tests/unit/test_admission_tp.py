"""The gate learns one load time per load job, however many tensor-parallel ranks report it (each rank loads its head
slice of the same requests at once, and vLLM aggregates their reports of a step into one)."""

from __future__ import annotations

from range_connector.config import RangeConfig
from range_connector.cost.gate import CostGate
from range_connector.kv.metadata import RangeWorkerMetadata
from range_connector.scheduler.admission import Admission, slowest_rank_per_load


class RecordingGate(CostGate):
    """The real gate, with every observed load also written down."""

    def __init__(self) -> None:
        super().__init__("valkey", 2, 2048.0, 4, 128, 256)
        self.observed: list[tuple[int, int, float, bool]] = []

    def observe_load(self, shard_idx, num_bytes, seconds, *, lower_bound=False, probe=False, tier=None) -> None:
        self.observed.append((shard_idx, num_bytes, seconds, lower_bound))
        super().observe_load(shard_idx, num_bytes, seconds, lower_bound=lower_bound, probe=probe, tier=tier)


def test_two_ranks_reports_of_one_job_are_one_sample_of_the_slowest_rank() -> None:
    rank0 = RangeWorkerMetadata(load_timings=[(("a", "b"), 4096, 0.010, True)])
    rank1 = RangeWorkerMetadata(load_timings=[(("a", "b"), 4096, 0.014, True), (("c",), 2048, 0.003, False)])
    report = rank0.aggregate(rank1)
    assert slowest_rank_per_load(report.load_timings) == [(("a", "b"), 4096, 0.014, True), (("c",), 2048, 0.003, False)]

    gate = RecordingGate()
    Admission(RangeConfig(), gate, 256, remote=True, stats={}).learn(report)
    # one observation per shard per job (2 shards x 2 jobs), not per rank
    assert gate.observed == [(0, 4096, 0.014, False), (1, 4096, 0.014, False),
                             (0, 2048, 0.003, True), (1, 2048, 0.003, True)]


def test_a_job_is_complete_only_if_every_rank_finished_it() -> None:
    timings = [(("a",), 1024, 0.5, False), (("a",), 2048, 0.2, True)]
    assert slowest_rank_per_load(timings) == [(("a",), 2048, 0.5, False)]

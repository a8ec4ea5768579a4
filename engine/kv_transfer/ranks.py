"""Each rank's side of the hand-off: a prefill rank exports its KV storage (a NIXL agent that peers READ from), a
decode rank receives (plans its descriptors for every pull of a step and READs them within the pull's deadline).

Built by the rank start-up path of a P/D instance once the KV cache is allocated; the model runner only asks the
receiver to carry out the pulls rank 0 put into a step.
"""

from __future__ import annotations

import logging
import uuid

from engine.attention.kv_layout import CacheGeometry
from engine.dcp import DcpSpec
from engine.kv_transfer import transport
from engine.kv_transfer.handles import KVPull, PullReport, RankEndpoint
from engine.kv_transfer.planner import PullSide, plan_pull
from engine.parallel_layout import ParallelLayout, kv_head_sources

logger = logging.getLogger("dcpctl.kv_transfer")


def _agent(kind: str, rank: int, geometry: CacheGeometry, on_gpu: bool) -> transport.Agent:
    name = f"dcpctl-{kind}-{uuid.uuid4().hex[:12]}-r{rank}"
    return transport.Agent(name, geometry.base_addr, geometry.nbytes, geometry.device_id, on_gpu)


class KVExporter:
    """A prefill rank: its KV storage registered with an agent that decode ranks READ from."""

    def __init__(self, rank: int, geometry: CacheGeometry, on_gpu: bool):
        self.geometry = geometry
        self.agent = _agent("prefill", rank, geometry, on_gpu)
        self.agent.start_progress()
        self.endpoint = RankEndpoint(rank, self.agent.name, self.agent.metadata(), geometry, self.agent.memory)

    def close(self) -> None:
        self.agent.close()


class KVReceiver:
    """A decode rank: carries out the pulls of a step into its own KV storage."""

    def __init__(
        self, rank: int, dcp_rank: int, layout: ParallelLayout, spec: DcpSpec, geometry: CacheGeometry, on_gpu: bool
    ):
        self.rank = rank
        self.dcp_rank = dcp_rank
        self.layout = layout
        self.spec = spec
        self.geometry = geometry
        self.agent = _agent("decode", rank, geometry, on_gpu)

    def pull(self, pulls: list[KVPull]) -> list[PullReport]:
        """Every pull of a step, one after the other; a failure is reported, never raised."""
        return [self._pull(p) for p in pulls]

    def _pull(self, pull: KVPull) -> PullReport:
        report = PullReport(pull.seq_id, self.rank)
        source = pull.source
        try:
            src_layout = ParallelLayout.build(
                source.tp,
                source.dcp,
                source.fingerprint["num_heads"],
                source.fingerprint["num_kv_heads"],
                source.fingerprint["is_mla"],
            )
            descriptors = plan_pull(
                PullSide(source.spec, pull.source_block_table, {r.rank: r.geometry for r in source.ranks}),
                PullSide(self.spec, pull.block_table, {self.rank: self.geometry}),
                self.rank,
                self.dcp_rank,
                kv_head_sources(src_layout, self.layout, self.rank),
                pull.start,
                pull.end,
            )
        except (ValueError, KeyError, TypeError) as exc:
            report.error = f"the transfer cannot be planned: {exc}"
            return report
        reads = []
        for src_rank, d in descriptors.items():
            endpoint = source.ranks[src_rank]
            reads.append((endpoint, d))
            report.descriptors += len(d)
            report.bytes += d.nbytes
        try:
            for endpoint, _ in reads:
                self.agent.connect(endpoint.agent, endpoint.metadata)
            report.seconds = self.agent.read(
                [(e.agent, e.geometry.device_id, d.src_addr, d.dst_addr, d.length) for e, d in reads],
                pull.timeout_s,
                reads[0][0].memory if reads else "DRAM",
            )
            if pull.measure_raw and reads:
                report.raw_seconds = sum(
                    self.agent.read_raw(
                        e.agent, e.geometry.device_id, e.geometry.base_addr, d.nbytes, pull.timeout_s, e.memory
                    )
                    for e, d in reads
                )
        except transport.TransferError as exc:
            report.error = str(exc)
            for endpoint, _ in reads:  # a failed peer is added again (with fresh metadata) next time
                self.agent.disconnect(endpoint.agent)
        return report

    def close(self) -> None:
        self.agent.close()

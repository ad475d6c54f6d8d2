"""Load balance of the sparse ring per layout, from the same index-to-work mapping the ring uses (no GPU).

    python -m benchmarks.ring_balance [--seqlens 131072 524288] [--worlds 4 8 16 32] [--documents mixed|TOKENS] \
        --out FILE

Planted vertical-slash indices (B=1, Hq=16, Hkv=2, D=128: Qwen2.5-3B-like; per head 64 sinks + 960 random
columns, a 2048-token local band and 512-token far bands up to the target density; block 64) for every
W in ``--worlds`` (4, 8, 16, 32), N in ``--seqlens`` (128K, 512K) and sparsity in {90, 95, 98} %. Work per (rank,
ring step) counts slash tiles (the diagonal tile as one) plus column work (columns x query tiles / 64), the
ring recomputing columns on the shard that holds them (``ds_mtraining.parallel.work``). "striped+gathered
(ring)" is what ``sparse_ring_attention(..., columns="gathered")`` does: the columns' K/V gathered once, query tile t's column
work at step t mod W. "striped+balancing" gathers the columns' K/V once and places their work, and the
own-shard tiles, into the light steps by the optimal fill of ``ds_mtraining.sim`` (a model the ring does not
follow yet). Metrics: per-step worker imbalance (max/mean over ranks within a step, averaged over
steps), step imbalance (max/mean over the steps of a rank, worst rank), worker imbalance (max/mean of the ranks'
totals), ring efficiency (Σ_s mean_r work / Σ_s max_r work).

``--documents`` packs every row with documents (``mixed``: lengths drawn log-uniformly from 512 to 64K tokens,
seeded; a number: documents of that many tokens): work then counts only the tiles and columns the kernels
compute inside the documents (``tile_work`` of the pattern with them), the same index as without.

The communication table replays one forward call at the largest W on nodes of 8 GPUs (``ds_mtraining.sim.timeline``:
each step's compute from the measured ring-step costs, ``sim.CALIBRATED``; K/V shards over NVLink 300 GB/s inside a
node and 25 GB/s a GPU across, the paper's cluster), flat ring vs hierarchical ring; with balancing the columns' K/V
are all-gathered first (over the inter-node link, not overlapped).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks import harness
from ds_mtraining.parallel.layout import make_layout
from ds_mtraining.parallel.work import RingWork, ring_sources, tile_work, work_on_schedule
from ds_mtraining.sim import (
    CALIBRATED,
    PRESETS,
    StepTerms,
    balance_tile_work,
    column_bytes,
    gathered_columns_work,
    ring_timeline,
    shard_bytes,
)
from ds_mtraining.sparse import AttentionPattern, Documents
from ds_mtraining.sparse.planted import planted_index

BLOCK, HEADS, KV_HEADS, HEAD_DIM = 64, 16, 2, 128
WORLDS = (4, 8, 16, 32)
SPARSITY = (0.90, 0.95, 0.98)
LAYOUTS = ("contiguous", "zigzag", "striped")
HEADER = (
    "| W | N | sparsity | density | layout | per-step worker imb. | step imb. | worker imb. | ring eff. |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def _row(world: int, n: int, sparsity: float, density: float, name: str, work: RingWork) -> str:
    return (
        f"| {world} | {n // 1024}K | {sparsity:.0%} | {density:.4f} | {name} | {work.step_worker_imbalance:.3f} | "
        f"{work.step_imbalance:.3f} | {work.worker_imbalance:.3f} | {work.ring_efficiency:.3f} |"
    )


def _comm_rows(index, n: int, world: int) -> list[str]:
    """Flat vs hierarchical ring at ``world``, plain striped vs balanced: forward ms and exposed time."""
    topology = PRESETS["a100"]
    layout = make_layout("striped", world, n, block_size=BLOCK)
    tw = tile_work(AttentionPattern(n, index), layout)
    shard = shard_bytes(layout.local_len, KV_HEADS, HEAD_DIM)
    gathered = column_bytes(AttentionPattern(n, index), KV_HEADS, HEAD_DIM)
    gather_ms = topology.hop_ms(gathered * (world - 1) / world, internode=world > topology.gpus_per_node)
    rows = []
    per_node = topology.gpus_per_node
    for ring, inner in (("flat", None), (f"hierarchical {world // per_node}x{per_node}", per_node)):
        sources = ring_sources(world, inner)
        for name, work, ready in (
            ("striped", work_on_schedule(tw, sources), 0.0),
            (
                "striped+balancing",
                balance_tile_work(tw, layout, sources, gather_columns=True, move_local=True).work,
                gather_ms,
            ),
        ):
            # Tile work only (the walks are a property of the kernels, not of the balance): columns at the tile rate.
            compute = CALIBRATED.forward(StepTerms(work.tiles + work.columns))
            t = ring_timeline(compute, topology, shard_bytes=shard, inner=inner, ready_ms=ready)
            busiest = float(compute.sum(1).max())
            rows.append(
                f"| {ring} | {name} | {busiest:.2f} | {t.total_ms:.2f} | {t.exposed_ms / t.total_ms:.0%} | "
                f"{t.efficiency:.2f} |"
            )
    note = (
        f"KV shard {shard / 2**20:.1f} MiB per step ({topology.hop_ms(shard, False):.3f} ms over NVLink, "
        f"{topology.hop_ms(shard, True):.3f} ms across nodes); gathered columns {gathered / 2**20:.1f} MiB per rank, "
        f"once; step costs: {CALIBRATED.source}."
    )
    header = "| ring | schedule | busiest rank's compute ms | total ms | exposed | ring efficiency |\n|---|---|---|---|---|---|"
    return [note, "", header, *rows]


def packed_documents(spec: str, n: int, seed: int) -> Documents:
    """One row of ``n`` tokens packed with documents: ``mixed`` lengths (log-uniform 512-64K) or ``spec`` tokens each."""
    if spec == "mixed":
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.exp(
            torch.empty(n // 512).uniform_(
                torch.log(torch.tensor(512.0)), torch.log(torch.tensor(65536.0)), generator=gen
            )
        )
        ends = lengths.long().cumsum(0)
        lengths = torch.diff(torch.cat([ends.new_zeros(1), ends.clamp(max=n)]))
        lengths = lengths[lengths > 0]
    else:
        size = int(spec)
        lengths = torch.full((-(-n // size),), size)
        lengths[-1] = n - size * (len(lengths) - 1)
    return Documents.from_document_ids(torch.repeat_interleave(torch.arange(len(lengths)), lengths)[None])


def _describe(documents: Documents) -> str:
    """One line on a packed row: documents, their lengths, and the in-document share of the causal entries."""
    starts = documents.starts[0]
    n = starts.numel()
    lengths = torch.bincount(starts)[torch.unique(starts)]
    inside = float((torch.arange(n) - starts + 1).sum()) / (n * (n + 1) / 2)
    return (
        f"N={n // 1024}K packed with {lengths.numel()} documents of {int(lengths.min())}-{int(lengths.max())} tokens "
        f"(median {int(lengths.median())}): {inside:.1%} of the causal entries are inside a document."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1 << 17, 1 << 19])
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS), help="ring sizes W")
    parser.add_argument("--documents", help="pack the rows: 'mixed' lengths or a document length in tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    seqlens, widest = args.seqlens, max(args.worlds)
    started = time.perf_counter()
    report = harness.Report(args.out)
    report.add(
        *harness.header("Sparse ring load balance", __spec__.name, argv, device="cpu"),
        "",
        (
            f"B=1, Hq={HEADS}, Hkv={KV_HEADS}, D={HEAD_DIM}, block {BLOCK}; planted indices (64 sinks + 960 "
            "columns, 2048-token local band, 512-token far bands), density = mean over heads of attended / causal "
            "entries."
        ),
        "",
        HEADER,
    )
    comm, notes = [], []
    for n in seqlens:
        for sparsity in SPARSITY:
            gen = torch.Generator().manual_seed(args.seed)
            index = planted_index(1, HEADS, n, BLOCK, density=1 - sparsity, generator=gen)
            density = float(index.density(n).mean())
            docs = packed_documents(args.documents, n, args.seed) if args.documents else None
            if docs is not None and sparsity == SPARSITY[0]:
                notes.append(_describe(docs))
            for world in args.worlds:
                for kind in LAYOUTS:
                    layout = make_layout(kind, world, n, block_size=BLOCK)
                    pattern = AttentionPattern(n, index, docs)
                    tw = tile_work(pattern, layout)
                    sources = ring_sources(world)
                    rows = [_row(world, n, sparsity, density, kind, work_on_schedule(tw, sources))]
                    if kind == "striped":
                        gathered = gathered_columns_work(pattern, layout)
                        rows.append(_row(world, n, sparsity, density, "striped+gathered (ring)", gathered))
                        balanced = balance_tile_work(tw, layout, sources, gather_columns=True, move_local=True)
                        rows.append(_row(world, n, sparsity, density, "striped+balancing", balanced.work))
                    report.add(*rows)
            if sparsity == 0.95 and n == seqlens[-1] and docs is None:
                comm = _levers(index, n, widest, density) + ["", *_comm_rows(index, n, widest)]
    section = ["", *notes] if notes else []
    if comm:
        section += [
            "",
            f"## Levers and communication at W={widest}, N={seqlens[-1] // 1024}K, 95 % sparsity",
            "",
            *comm,
        ]
    report.add(*section, "", f"Runtime: {time.perf_counter() - started:.0f} s.")
    return 0


def _levers(index, n: int, world: int, density: float) -> list[str]:
    """Each balancing lever alone and together at ``world``, on the striped and the zigzag ring."""
    rows = [HEADER]
    for kind in ("striped", "zigzag"):
        layout = make_layout(kind, world, n, block_size=BLOCK)
        tw = tile_work(AttentionPattern(n, index), layout)
        sources = ring_sources(world)
        rows.append(_row(world, n, 0.95, density, kind, work_on_schedule(tw, sources)))
        for name, gather, local in (
            ("+ gathered columns", True, False),
            ("+ own-shard tiles moved", False, True),
            ("+ both", True, True),
        ):
            work = balance_tile_work(tw, layout, sources, gather_columns=gather, move_local=local).work
            rows.append(_row(world, n, 0.95, density, f"{kind} {name}", work))
    return rows


if __name__ == "__main__":
    sys.exit(main())

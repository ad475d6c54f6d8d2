"""Sparse ring attention (context parallelism), flat or hierarchical, forward and backward.

Each ring rank holds one layout shard of q, k, v. The KV shards travel around the ring; at every step a rank
runs the sparse kernel on the (its queries, KV shard in hand) pair — exactly the tiles and columns of the
global index that fall in that pair — and merges into a running (out, lse) in fp32. The next shard is posted
before the compute, so the transfer hides behind it. The backward runs the same schedule and sends each
shard's dK/dV accumulator along with it, one hop behind, so it arrives home after the last step.

Kernels (``StepKernels``): on CUDA the Triton kernels, told where each shard's tiles lie in the global
sequence by tile maps built once per call on the device (the index's kernel form, for the global padded length,
is built by the first step and cached on the index for the others and the backward); elsewhere the PyTorch path,
with the same semantics. A step runs with only the columns of the shard in hand and, on Triton, only the slash
offsets that reach it (``shard_index``): the kernels walk every column and offset of their index before a query
tile, so the whole lists would cost the whole walks at every step.
The gathered-column pass is PyTorch on every device.

Hierarchical: ranks form an inner ring inside a node (``RingGroups.inner``) and an outer ring across nodes
(``RingGroups.outer``). Every outer step posts the inter-node transfer of the node's KV, runs the whole inner
ring on what is local, then waits: the slow link hides behind ``inner_size`` steps of compute. At outer step t
and inner step u, ring rank (node n, local l) holds the shard of ring rank
``((n - t) mod outer_size) * inner_size + (l - u) mod inner_size``; a flat ring is ``outer_size = 1``.

K/V exchange inside the inner group (``kv_exchange``): ``"ring"`` passes shards one hop per step, as above;
``"all_gather"`` all-gathers the ``inner_size`` shards the group holds at an outer step and attends them in one
kernel call (their tiles placed by one tile map), and in the backward reduce-scatters that call's dK/dV back to the
shards' holders. A step's kernels pay a fixed cost and one program per (head, local query tile) whatever the shard
holds (``benchmarks/results/2026-12-06-h100-ring_steps_residue_offsets.md``), so ``inner_size`` steps cost that
``inner_size`` times where one step over the gathered shards costs it once; the price is the gathered K/V, which GQA
keeps small (``Hkv / Hq`` of q's size per shard). A flat ring with ``"all_gather"`` is one all-gather of the whole
sequence's K/V, as Llama 3's context parallelism does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar

import torch
import torch.distributed as dist

from ..sparse import torch_path
from ..sparse.attention import kernel_backend, resolve_softmax_scale
from ..sparse.index import VerticalSlashIndex
from ..sparse.pattern import AttentionPattern
from .comm import RingComm, RingGroups, current_layer, deadline
from .layout import Layout
from .work import StepLoad, offset_shards, offsets_reaching

if TYPE_CHECKING:  # the Triton kernels' index form; importing it at run time would import Triton
    from ..sparse.triton.kernel_index import KernelIndex, TileMap

R = TypeVar("R")
KVExchange = Literal["ring", "all_gather"]
_KV, _DKV = 0, 1  # tags of the two streams that share the ring links in the backward


@dataclass
class RingTrace:
    """What each ring step did on this rank, in the order the steps ran: the wall time of its compute, and with
    ``work=True`` the work its kernels attended. Gather it over the ring with :func:`gather_step_times` and
    :func:`gather_step_work`.

    Attributes:
        forward_ms / backward_ms: each step's compute (ms; on CUDA synchronised around the step: profiling only).
        work: also count each forward step's work from the PyTorch path's gather plan (``torch_path.planned_work``,
            the plan the Triton kernels share), outside the timed compute; the backward walks the same plan.
        sources: the ring ranks whose K/V shards each forward step held (one, or an all-gathered inner group's).
        tiles: slash tiles each forward step attended (the diagonal one as one), over the query tiles that hold a
            real row.
        columns: the step's column work (tile units), per-step or gathered, over the same query tiles.
        padding_tiles: slash tiles the step spent on query tiles made only of layout padding (computed and
            dropped; the work model ``parallel.work`` leaves them out).
    """

    work: bool = False
    forward_ms: list[float] = field(default_factory=list)
    backward_ms: list[float] = field(default_factory=list)
    sources: list[range] = field(default_factory=list)
    tiles: list[float] = field(default_factory=list)
    columns: list[float] = field(default_factory=list)
    padding_tiles: list[float] = field(default_factory=list)


class _Schedule:
    """The shards each (outer step, inner step) holds, and the communicators that move shards."""

    def __init__(
        self, groups: RingGroups, layout: Layout, device: torch.device, layer: int | None = None,
        kv_exchange: KVExchange = "ring",
    ):  # fmt: skip
        self.groups, self.layout, self.layer = groups, layout, layer
        self.gather = kv_exchange == "all_gather"
        outer = groups.outer is not None
        inner = " (inner ring)" if outer else ""
        self.inner_kv = RingComm(groups.inner, name="KV" + inner, layer=layer)
        self.inner_dkv = RingComm(groups.inner, name="dK/dV" + inner, layer=layer)
        self.outer_kv = RingComm(groups.outer, name="KV (outer ring)", layer=layer) if outer else None
        self.outer_dkv = RingComm(groups.outer, name="dK/dV (outer ring)", layer=layer) if outer else None
        self.me = groups.rank
        # Host copies decide which steps have work (no device sync); device copies place the kernels' tiles.
        self.blocks = [layout.block_ids(r) for r in range(groups.size)]
        self.tile_blocks = [layout.block_ids_on(r, device) for r in range(groups.size)]

    @property
    def inner_steps(self) -> int:
        """Steps of one inner pass: one over the gathered shards, or one per inner ring rank."""
        return 1 if self.gather else self.groups.inner_size

    @property
    def steps(self) -> int:
        return self.groups.outer_size * self.inner_steps

    def phase(self, phase: str) -> None:
        """Name the pass (``"forward"`` / ``"backward"``) the transfers belong to, for their timeout errors."""
        for comm in (self.inner_kv, self.inner_dkv, self.outer_kv, self.outer_dkv):
            if comm is not None:
                comm.phase = phase

    def sources(self, outer_step: int, inner_step: int) -> range:
        """The ring ranks whose shards this rank holds at the step, in the order they lie in the K/V in hand: one
        rank, or (all-gather) the inner group's ``inner_size`` consecutive ones."""
        g, m = self.groups.inner_size, self.groups.outer_size
        node, local = divmod(self.me, g)
        first = ((node - outer_step) % m) * g
        if self.gather:
            return range(first, first + g)
        src = first + (local - inner_step) % g
        return range(src, src + 1)

    def has_work(self, srcs: range) -> bool:
        """False when every key of the shards ``srcs`` comes after every query here (nothing is causal)."""
        mine = self.blocks[self.me].max()
        return any(bool(self.blocks[s].min() <= mine) for s in srcs)

    def gather_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """The inner group's shards in hand, ``kv`` ``[2, B, n, Hkv, D]`` each, as one ``[2, B, g * n, Hkv, D]`` in
        inner-rank order (the order of :meth:`sources`)."""
        g = self.groups.inner_size
        two, b, n, h, d = kv.shape
        out = torch.empty((g * two, b, n, h, d), dtype=kv.dtype, device=kv.device)
        with deadline("all-gather of the inner group's K/V", group=self.groups.inner, layer=self.layer):
            _all_gather_single(out, kv.contiguous(), group=self.groups.inner)
        return out.view(g, two, b, n, h, d).permute(1, 2, 0, 3, 4, 5).reshape(two, b, g * n, h, d)

    def scatter_dkv(self, dkv: torch.Tensor) -> torch.Tensor:
        """The sum over the inner group of each rank's ``dkv`` ``[2, B, g * n, Hkv, D]`` (:meth:`gather_kv`'s layout),
        this rank's shard of it ``[2, B, n, Hkv, D]``."""
        g = self.groups.inner_size
        two, b, gn, h, d = dkv.shape
        parts = dkv.view(two, b, g, gn // g, h, d).permute(2, 0, 1, 3, 4, 5).reshape(g * two, b, gn // g, h, d)
        out = torch.empty(parts.shape[0] // g, *parts.shape[1:], dtype=dkv.dtype, device=dkv.device)
        with deadline("reduce-scatter of the inner group's dK/dV", group=self.groups.inner, layer=self.layer):
            _reduce_scatter_single(out, parts, group=self.groups.inner)
        return out


# torch 2.13 renamed the tensor forms of the two collectives (the old names warn); the device's torch 2.11 has only
# the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatheredColumns:
    """Each head's vertical columns' K/V, gathered once over the ring, and the steps their work runs at.

    The columns are few, so one all-reduce gives every rank all of them; then no step depends on which shard
    holds a column (with per-step columns, the sink columns' work lands on whichever rank holds shard 0 at
    that step, and every other rank waits). Local query tile ``t`` runs its column work at ring step
    ``t mod steps`` (``W`` steps, or the outer ring's with an all-gathered inner group): an even spread. In the
    backward the columns' dK/dV are summed over the ring the same way and each owner adds its columns' share into its
    dK/dV shard.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, index: VerticalSlashIndex, schedule: _Schedule):
        b, n, hkv, _ = k.shape
        heads, device = index.heads, k.device
        local_of = torch.full((schedule.layout.padded_len,), -1, dtype=torch.long, device=device)
        local_of[schedule.layout.positions_on(schedule.me, device)] = torch.arange(n, device=device)
        where = local_of[index.vertical.clamp(min=0)]
        self.here = (index.vertical >= 0) & (where >= 0)  # [B, Hq, Kv]: columns in this rank's shard
        self.local = torch.where(self.here, where, 0)
        self.kv_head = (torch.arange(heads, device=device) // (heads // hkv))[None, :, None]
        self.batch = torch.arange(b, device=device)[:, None, None]
        kv = torch.stack([k, v])[:, self.batch, self.local, self.kv_head]  # [2, B, Hq, Kv, D]
        self.kv = torch.where(self.here[..., None], kv, 0)
        self.group, self.layer = schedule.groups.ring, schedule.layer
        with deadline("all-reduce of the gathered columns' K/V (forward)", group=self.group, layer=self.layer):
            dist.all_reduce(self.kv, group=self.group)  # one owner per column: the sum is a gather
        # Tile t runs at step t mod W; built as ranges, not by `nonzero` (a host sync at every ring step).
        tiles = torch.arange(n // index.block_size, device=device)
        self.step_tiles = [tiles[step :: schedule.steps].contiguous() for step in range(schedule.steps)]

    def tiles(self, step: int) -> torch.Tensor:
        return self.step_tiles[step]

    def add_gradients(self, dcols: torch.Tensor, dkv: torch.Tensor) -> None:
        """Sum ``dcols`` ``[2, B, Hq, Kv, D]`` over the ring and add the owned columns' rows into ``dkv``
        ``[2, B, n, Hkv, D]`` (GQA: every query head of a group adds into its kv head)."""
        with deadline("all-reduce of the gathered columns' dK/dV (backward)", group=self.group, layer=self.layer):
            dist.all_reduce(dcols, group=self.group)
        _, n, hkv, d = dkv.shape[1:]
        rows = ((self.batch * n + self.local) * hkv + self.kv_head).expand_as(self.here)[self.here]
        dkv.view(2, -1, d).index_add_(1, rows, dcols[:, self.here].to(dkv.dtype))


def shard_index(
    index: VerticalSlashIndex,
    owner: torch.Tensor,
    srcs: range,
    form: KernelIndex | None = None,
    reach: torch.Tensor | None = None,
    kv_map: TileMap | None = None,
    reaching: Sequence[int] | None = None,
) -> VerticalSlashIndex | KernelIndex:
    """The index a ring step over the shards of ring ranks ``srcs`` runs: ``index`` with only the columns those shards
    hold and, for the Triton kernels, only the slash offsets that can reach them.

    The kernels walk, before each query tile, every column of their index (in chunks, loading and masking those they
    do not attend) and every chosen offset up to the tile (a scalar load and a tile-map lookup each, wherever the key
    tile lies), so with the whole index each of the W steps would pay the whole walk: 62-89 % of a step for the
    columns; for the offsets, with the query-tile programs, 80 % of a 512K, W = 32 step
    (``benchmarks/results/2026-12-05-ring_steps_shard_columns.md``). With the shard's own, a call walks each list once
    over all its steps.

    ``owner``: LongTensor ``[num_blocks]``, the ring rank holding each global block. ``srcs``: consecutive ring ranks
    (one, or an all-gathered inner group). With ``form`` (the whole index's ``KernelIndex``) the result is a
    ``KernelIndex``; with ``reach`` too (``parallel.work.offset_shards`` of the query rank, LongTensor
    ``[num_blocks, ·]`` on the index's device) its offsets are those whose row of ``reach`` holds one of ``srcs``
    (striped: one residue class mod W per rank, ``len(srcs) / W`` of them), offset 0 first as the kernels expect, the
    offset bitmap kept whole (``replace_slash``), and with several ``srcs`` each shard's own for the dk/dv pass
    (``replace_key_slash``), cut with ``reaching`` (``parallel.work.offsets_reaching`` of the query rank: how many
    offsets can reach each ring rank) to the longest list they allow, the diagonal included (None: as wide as the
    index). With ``form`` and ``kv_map`` (the ``TileMap`` of the K/V in hand: the shards of ``srcs`` laid end to end)
    also its columns' local rows in that K/V (``replace_column_rows``), which the launchers would otherwise compute at
    every call. Without ``form``, a ``VerticalSlashIndex`` with every offset (the PyTorch path loops over tiles, not
    offsets). Device ops only, no host sync.
    """

    def held(ranks: torch.Tensor) -> torch.Tensor:
        return (ranks >= srcs.start) & (ranks < srcs.stop)

    shard = index
    if index.vertical.shape[-1] > 0:
        shard = index.keep_columns(held(owner[index.vertical.clamp(min=0) // index.block_size]))
    if form is None:
        return shard
    from ..sparse.triton.kernel_index import (  # only where Triton runs
        CHUNK_ELEMENTS,
        replace_column_rows,
        replace_columns,
        replace_key_slash,
        replace_slash,
    )

    if shard is not index:
        form = replace_columns(form, shard.vertical)
    if kv_map is not None:
        form = replace_column_rows(form, kv_map)
    if reach is None:
        return form
    reaches = reach[index.slash.clamp(min=0)]  # [B, Hq, Ks, ·]: the key ranks each offset reaches from here
    slash = index.slash.to(torch.int32)  # the kernels' dtype: half the sorts' bytes
    big = torch.iinfo(torch.int32).max

    def kept(reached: torch.Tensor) -> torch.Tensor:  # canonical: offset 0 first, ascending, -1 last
        ordered = torch.where((reached & (slash > 0)) | (slash == 0), slash, big).sort(-1).values
        return torch.where(ordered == big, -1, ordered)

    form = replace_slash(form, kept(held(reaches).any(-1)))
    if len(srcs) == 1:
        return form
    # From a key tile the group's offsets reach the q shard by its own shard's only (one residue class, striped).
    # Sorted a few shards at a time and cut to the longest list: the sort of all G shards' lists at once asked 16 GiB
    # at 4M tokens on 1024 gathered shards (int64 values and positions), and G lists as wide as the index 4 GiB.
    ranks = torch.arange(srcs.start, srcs.stop, device=slash.device)[:, None, None, None, None]
    step = max(1, CHUNK_ELEMENTS // max(slash.numel(), 1))
    width = slash.shape[-1] if reaching is None else min(1 + max(reaching[s] for s in srcs), slash.shape[-1])
    return replace_key_slash(
        form,
        torch.cat([kept((reaches[None] == ranks[g : g + step]).any(-1))[..., :width]
                   for g in range(0, len(srcs), step)]),
    )  # fmt: skip


def column_widths(index: VerticalSlashIndex, owner: torch.Tensor, world: int) -> torch.Tensor:
    """int64 ``[world]`` on the index's device: for each ring rank, the most columns of ``index`` that one (batch,
    head) has in its shard (``owner``: LongTensor ``[num_blocks]``, the rank holding each global block). A step over
    the shards of ``srcs`` lists at most their sum per row, which is what its backward's column lists are cut to
    (``kernel_index.narrow_columns``). Device ops only."""
    b, h = index.vertical.shape[:2]
    held = index.vertical >= 0
    ranks = owner[index.vertical.clamp(min=0) // index.block_size]
    counts = torch.zeros(b, h, world, dtype=torch.long, device=index.vertical.device)
    return counts.scatter_add_(2, ranks, held.long()).amax((0, 1))


def _to_host(x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``x`` on the host, copied without waiting (pinned memory) from a GPU, and the event to wait on before reading
    it (None: already there)."""
    if not x.is_cuda:
        return x, None
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


class StepKernels:
    """The sparse kernels of one rank's ring steps, and their inputs in the form they read: built once per call
    (forward), kept for the backward. ``benchmarks.ring_steps`` times each step through these same calls.

    The steps run the launcher module of the inputs' device (``kernel_backend``): on CUDA the Triton kernels,
    which place each shard's tiles in the global sequence through tile maps; elsewhere the PyTorch path. For
    Triton every ring rank's ``TileMap`` is built on the device and the index's kernel form is converted once,
    for the global (padded) sequence the maps span, and cached on the index (``VerticalSlashIndex.kernel_index``),
    so no later step converts anything and none synchronises with the host. The gathered-column pass (a few
    batched dense products) runs on the PyTorch path on every device.

    Args:
        q: ``[B, n, Hq, D]``, ring rank ``me``'s query shard (its device and dtype pick the backend).
        index: the whole rows' index (``[B, Hq, ·]`` over ``layout.seqlen`` tokens).
        layout: the ring's token layout; ``me``: this rank's shard of it.
        tile_blocks: every ring rank's global blocks on ``q``'s device (``layout.block_ids_on``), built once by the
            caller (a ring's schedule keeps them for all its layers).
        gather: the columns are attended by the gathered-column pass, so the steps take only the slash part.
        doc_start: the local rows' document starts (global positions, ``[B, n]`` int), or None.
    """

    def __init__(
        self,
        q: torch.Tensor,
        index: VerticalSlashIndex,
        layout: Layout,
        me: int,
        tile_blocks: Sequence[torch.Tensor],
        *,
        gather: bool = False,
        doc_start: torch.Tensor | None = None,
    ):
        self.backend = kernel_backend(q)
        self.me = me
        self.index = _split_columns(index, gather)
        self.doc_start = doc_start
        self.blocks, self.local_len = tile_blocks, layout.local_len
        self.real_blocks = -(-layout.seqlen // index.block_size)
        num_blocks = self.index.num_blocks(layout.padded_len)
        self.owner = layout.block_owner_on(q.device)  # global block -> ring rank
        self.shards: dict[range, VerticalSlashIndex | KernelIndex] = {}
        self.maps: dict[range, torch.Tensor | TileMap] = {}
        self.form = self.reach = self.reaching = self.widths = None
        self.num_blocks = num_blocks
        if self.backend is not torch_path:
            self.form = self.index.kernel_index(layout.padded_len)
            self.reach = offset_shards(layout, self.me, q.device)
            self.reaching = offsets_reaching(layout, self.me)  # host: the per-shard lists' widths
            self.widths = _to_host(column_widths(self.index, self.owner, layout.world))
        self.narrowed: dict[range, KernelIndex] = {}
        self.q_map = self.kv_map(range(self.me, self.me + 1))

    def kv_blocks(self, srcs: range) -> torch.Tensor:
        """The global block of each tile of the K/V in hand (the shards of ``srcs``, in order)."""
        return torch.cat([self.blocks[r] for r in srcs])

    def kv_map(self, srcs: range) -> torch.Tensor | TileMap:
        """Where the tiles of the K/V in hand lie in the global sequence: :meth:`kv_blocks` (PyTorch path) or their
        ``TileMap`` (Triton), built on first use and kept."""
        if srcs not in self.maps:
            blocks = self.kv_blocks(srcs)
            self.maps[srcs] = blocks if self.backend is torch_path else self.backend.prepare_tile_map(
                blocks, self.num_blocks
            )  # fmt: skip
        return self.maps[srcs]

    def step_index(self, srcs: range) -> VerticalSlashIndex | KernelIndex:
        """The index of the steps over the shards of ``srcs`` (:func:`shard_index`), built on first use and kept for
        the backward (per step, for Triton, a column and a slash part of ``[B, Hq, num_blocks (+ 1)]`` int32 each, and
        the columns' local rows in the K/V in hand, shaped like the columns)."""
        if srcs not in self.shards:
            kv_map = None if self.form is None else self.kv_map(srcs)
            self.shards[srcs] = shard_index(self.index, self.owner, srcs, self.form, self.reach, kv_map, self.reaching)
        return self.shards[srcs]

    def backward_index(self, srcs: range) -> VerticalSlashIndex | KernelIndex:
        """:meth:`step_index` with its column lists cut to the most the shards of ``srcs`` can hold
        (``column_widths``, copied to the host when the call began, long arrived by its backward), built on first use
        and kept: the column pass of a step that holds one chunk of columns a head then splits its query tiles over
        enough programs to fill the GPU, where the whole index's list width allowed one program a head."""
        if self.widths is None:
            return self.step_index(srcs)
        if srcs not in self.narrowed:
            from ..sparse.triton.kernel_index import narrow_columns  # only where Triton runs

            widths, ready = self.widths
            if ready is not None:
                ready.synchronize()
            self.narrowed[srcs] = narrow_columns(self.step_index(srcs), int(widths[srcs.start : srcs.stop].sum()))
        return self.narrowed[srcs]

    def forward(
        self, q: torch.Tensor, kv: torch.Tensor, scale: float, out: torch.Tensor, lse: torch.Tensor, srcs: range
    ) -> None:
        """Merge the attention of the local ``q`` over the shards of ring ranks ``srcs``, ``kv``
        ``[2, B, len(srcs) * n, Hkv, D]``, into the running ``out`` / ``lse`` (compute dtype) in place."""
        self.backend.vertical_slash_forward(
            q,
            kv[0],
            kv[1],
            self.step_index(srcs),
            scale,
            out=out,
            lse=lse,
            q_blocks=self.q_map,
            kv_blocks=self.kv_map(srcs),
            doc_start=self.doc_start,
        )

    def record_work(
        self,
        trace: RingTrace,
        srcs: range,
        runs: bool,
        index: VerticalSlashIndex,
        column_tiles: torch.Tensor | None,
    ) -> None:
        """Append to ``trace`` the work of this rank's step over the shards of ``srcs`` (``runs``: whether its kernels
        run, ``_Schedule.has_work``), counted from the PyTorch path's plan of the same call, and of the gathered-column
        pass over the local query tiles ``column_tiles`` (of the whole ``index``) when the columns are gathered."""
        mine = self.blocks[self.me]
        if runs:
            tiles, cols = torch_path.planned_work(
                self.index, self.local_len, len(srcs) * self.local_len, q_blocks=mine,
                kv_blocks=self.kv_blocks(srcs), doc_start=self.doc_start,
            )  # fmt: skip
        else:
            tiles = cols = torch.zeros(mine.numel(), dtype=torch.float64)
        if column_tiles is not None:
            done = torch_path.planned_column_work(index, column_tiles, mine, self.doc_start)
            cols = cols.index_add(0, column_tiles.cpu(), done)
        real = mine.cpu() < self.real_blocks
        trace.sources.append(srcs)
        trace.tiles.append(float(tiles[real].sum()))
        trace.columns.append(float(cols[real].sum()))
        trace.padding_tiles.append(float(tiles[~real].sum()))

    def backward(
        self,
        do: torch.Tensor,
        q: torch.Tensor,
        kv: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        scale: float,
        srcs: range,
        delta: torch.Tensor,
        dq: torch.Tensor,
    ) -> torch.Tensor:
        """This step's dq added into the running ``dq`` (compute dtype, like q), and its dK/dV of the K/V in hand
        returned, ``[2, B, len(srcs) * n, Hkv, D]`` in the compute dtype; ``out`` / ``lse`` are the rows' final values,
        ``delta`` their ``rowsum(dO * out)`` (the backend's ``backward_delta``, once for every step)."""
        dkv = torch.empty((2, *kv.shape[1:]), dtype=dq.dtype, device=kv.device)
        self.backend.vertical_slash_backward(
            do,
            q,
            kv[0],
            kv[1],
            out,
            lse,
            self.backward_index(srcs),
            scale,
            q_blocks=self.q_map,
            kv_blocks=self.kv_map(srcs),
            doc_start=self.doc_start,
            delta=delta,
            dq=dq,
            dkv=dkv,
        )
        return dkv


def _timed(
    step: Callable[[torch.Tensor, int], R], times: list[float] | None, before: Callable[[int], None] | None = None
) -> Callable[[torch.Tensor, int], R]:
    """``step`` that appends its wall time (ms) to ``times``; every step is timed, idle ones too, so each
    rank records the same number of steps. On CUDA this synchronises around each step: profiling only.
    ``before(u)`` runs ahead of each step, outside the time (the trace's work count)."""
    if times is None:
        return step

    def timed(kv: torch.Tensor, u: int) -> R:
        if before is not None:
            before(u)
        if kv.is_cuda:
            torch.cuda.synchronize(kv.device)
        start = time.perf_counter()
        result = step(kv, u)
        if kv.is_cuda:
            torch.cuda.synchronize(kv.device)
        times.append(1e3 * (time.perf_counter() - start))
        return result

    return timed


def _gather_rows(values: list[float], groups: RingGroups, what: str) -> torch.Tensor:
    """Every rank's ``values`` as float64 ``[W, len]`` in ring order; collective over ``groups.ring``."""
    # NCCL gathers device tensors only; gloo host tensors.
    nccl = dist.get_backend(groups.ring) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    local = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(groups.size)]
    with deadline(f"all-gather of the ring {what}", group=groups.ring):
        dist.all_gather(gathered, local, group=groups.ring)
    # all_gather lists ranks in group order; the ring's own order is what the metrics are about.
    position = torch.tensor([groups.rank], dtype=torch.long, device=device)
    positions = [torch.empty_like(position) for _ in range(groups.size)]
    with deadline(f"all-gather of the ring {what}", group=groups.ring):
        dist.all_gather(positions, position, group=groups.ring)
    return torch.stack(gathered)[torch.cat(positions).argsort()].cpu()


def gather_step_times(trace: RingTrace, groups: RingGroups) -> tuple[StepLoad, StepLoad]:
    """Every rank's recorded step times as forward and backward :class:`StepLoad` ``[W, steps]`` (ms), with
    their worker- and step-level imbalance; collective over ``groups.ring``, same result on every rank."""
    return (
        StepLoad(_gather_rows(trace.forward_ms, groups, "step times")),
        StepLoad(_gather_rows(trace.backward_ms, groups, "step times")),
    )


def gather_step_work(trace: RingTrace, groups: RingGroups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rank's counted forward work (a ``RingTrace(work=True)``): slash tiles, column work (tile units) and
    padding tiles per (ring rank, step), float64 ``[W, steps]`` each, in the layout of ``parallel.work.RingWork``
    (``tiles``, ``columns``); collective over ``groups.ring``, same result on every rank."""
    if not trace.work:
        raise ValueError("gather_step_work needs a RingTrace(work=True): this trace counted no work")
    return tuple(_gather_rows(x, groups, "step work") for x in (trace.tiles, trace.columns, trace.padding_tiles))


def _ring_pass(
    start: torch.Tensor,
    step: Callable[[torch.Tensor, int], torch.Tensor | None],
    size: int,
    kv_comm: RingComm | None,
    dkv_comm: RingComm | None = None,
) -> torch.Tensor | None:
    """Walk ``size`` steps of a ring starting from the shard ``start``; ``step(kv, u)`` computes on each.

    The next shard is posted before each step's compute and received into one of two preallocated buffers
    (the one sent two steps ago, whose transfer has completed). With ``dkv_comm`` (backward), ``step`` returns
    its dK/dV for the shard in hand; the accumulator follows the shard one hop behind, and the summed dK/dV of
    ``start``'s shard is returned after its last hop brings it home.
    """
    spares = [torch.empty_like(start) for _ in range(min(size - 1, 2))]
    kv, arrived, total = start, None, None
    dkv_spares: list[torch.Tensor] = []
    for u in range(size):
        if u + 1 < size:
            next_kv = kv_comm.send_recv(kv, spares[u % 2], tag=_KV, step=u)
        total = step(kv, u)
        if dkv_comm is not None and size > 1:
            if u > 0:
                dkv_comm.wait()
                total += arrived
            if not dkv_spares:
                dkv_spares = [torch.empty_like(total) for _ in range(2)]
            arrived = dkv_comm.send_recv(total, dkv_spares[u % 2], tag=_DKV, step=u)  # the last hop delivers it home
        if u + 1 < size:
            kv_comm.wait()
            kv = next_kv
    if dkv_comm is None or size == 1:
        return total
    dkv_comm.wait()
    return arrived


def _split_columns(index: VerticalSlashIndex, gather: bool) -> VerticalSlashIndex:
    """The index the ring steps run: without its columns when they are gathered and run on their own."""
    if not gather:
        return index
    return VerticalSlashIndex(index.vertical[..., :0], index.slash, index.block_size)


def _ring_forward(q, k, v, index, scale, columns, kernels: StepKernels, schedule: _Schedule, trace: RingTrace | None):
    doc_start = kernels.doc_start
    b, n, hq, d = q.shape
    compute = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(b, n, hq, d, dtype=compute, device=q.device)
    lse = torch.full((b, hq, n), -math.inf, dtype=compute, device=q.device)
    blocks, me = schedule.tile_blocks, schedule.me
    schedule.phase("forward")

    def inner_pass(outer_kv: torch.Tensor, t: int) -> None:
        def step(kv: torch.Tensor, u: int) -> None:
            srcs = schedule.sources(t, u)
            if schedule.has_work(srcs):
                kernels.forward(q, kv, scale, out, lse, srcs)
            if columns is not None:
                torch_path.gathered_columns_forward(
                    q,
                    columns.kv[0],
                    columns.kv[1],
                    index,
                    scale,
                    tiles=columns.tiles(t * schedule.inner_steps + u),
                    q_blocks=blocks[me],
                    out=out,
                    lse=lse,
                    doc_start=doc_start,
                )

        def record(u: int) -> None:
            tiles = None if columns is None else columns.tiles(t * schedule.inner_steps + u)
            srcs = schedule.sources(t, u)
            kernels.record_work(trace, srcs, schedule.has_work(srcs), index, tiles)

        timed = _timed(step, trace.forward_ms if trace else None, record if trace and trace.work else None)
        if schedule.gather:
            timed(schedule.gather_kv(outer_kv), 0)
        else:
            _ring_pass(outer_kv, timed, schedule.groups.inner_size, schedule.inner_kv)

    _ring_pass(torch.stack([k, v]), inner_pass, schedule.groups.outer_size, schedule.outer_kv)
    return out.to(q.dtype), lse


def _ring_backward(
    do,
    q,
    k,
    v,
    out,
    lse,
    index,
    scale,
    columns,
    kernels: StepKernels,
    schedule: _Schedule,
    trace: RingTrace | None,
):
    compute = torch.promote_types(q.dtype, torch.float32)
    doc_start = kernels.doc_start
    # The steps add into one running dq and share one delta: no per-step dq to add, no delta kernel per step.
    dq = torch.zeros_like(q, dtype=compute)
    delta = kernels.backend.backward_delta(do, out)
    blocks, me = schedule.tile_blocks, schedule.me
    dcols = None if columns is None else torch.zeros(columns.kv.shape, dtype=compute, device=q.device)
    schedule.phase("backward")

    def contribution(kv: torch.Tensor, srcs: range) -> torch.Tensor:
        """This rank's dK/dV for the K/V in hand ``kv`` (the shards of ``srcs``), stacked like it
        ``[2, B, len(srcs) * n, Hkv, D]``."""
        if not schedule.has_work(srcs):
            return torch.zeros(kv.shape, dtype=compute, device=kv.device)
        return kernels.backward(do, q, kv, out, lse, scale, srcs, delta, dq)

    def inner_pass(outer_kv: torch.Tensor, t: int) -> torch.Tensor:
        def step(kv: torch.Tensor, u: int) -> torch.Tensor:
            if columns is not None:
                torch_path.gathered_columns_backward(
                    do,
                    q,
                    columns.kv[0],
                    columns.kv[1],
                    out,
                    lse,
                    index,
                    scale,
                    tiles=columns.tiles(t * schedule.inner_steps + u),
                    q_blocks=blocks[me],
                    dq=dq,
                    dk_cols=dcols[0],
                    dv_cols=dcols[1],
                    doc_start=doc_start,
                )
            return contribution(kv, schedule.sources(t, u))

        timed = _timed(step, trace.backward_ms if trace else None)
        if schedule.gather:  # every rank joins the reduce-scatter, with zeros where its step had no work
            return schedule.scatter_dkv(timed(schedule.gather_kv(outer_kv), 0))
        return _ring_pass(outer_kv, timed, schedule.groups.inner_size, schedule.inner_kv, schedule.inner_dkv)

    dkv = _ring_pass(torch.stack([k, v]), inner_pass, schedule.groups.outer_size, schedule.outer_kv, schedule.outer_dkv)
    if columns is not None:
        columns.add_gradients(dcols, dkv)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class SparseRingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, index, scale, gather, schedule, trace, doc_start):
        # Gathered once here and kept for the backward: one all-reduce of the columns per call, not two.
        columns = _GatheredColumns(k, v, index, schedule) if gather else None
        kernels = StepKernels(  # the backward reuses its maps
            q, index, schedule.layout, schedule.me, schedule.tile_blocks, gather=gather, doc_start=doc_start
        )
        out, lse = _ring_forward(q, k, v, index, scale, columns, kernels, schedule, trace)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (index, scale, columns, kernels, schedule, trace)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        index, scale, columns, kernels, schedule, trace = ctx.args
        grads = _ring_backward(dout.contiguous(), q, k, v, out, lse, index, scale, columns, kernels, schedule, trace)
        return (*grads, None, None, None, None, None, None)


def sparse_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: AttentionPattern | None,
    *,
    groups: RingGroups,
    layout: Layout,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    columns: Literal["per_step", "gathered"] = "per_step",
    check_index: bool = True,
    trace: RingTrace | None = None,
    layer: int | None = None,
    kv_exchange: KVExchange = "ring",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over a sequence sharded on a ring, restricted to a global attention pattern.

    Args:
        q: ``[B, n, Hq, D]``, this rank's shard (``n = layout.local_len``, tokens in layout order).
        k, v: ``[B, n, Hkv, D]``, the same shard of keys and values (``Hq % Hkv == 0``, GQA).
        pattern: the *whole* rows' pattern (``AttentionPattern`` over ``layout.seqlen`` tokens, the same on every
            rank): its index in positions of the unpermuted sequence (``[B, Hq, ·]``, ``block_size ==
            layout.block_size``; ``None``: the dense causal ring with the same schedule) and its packed documents
            (each query attends only keys of its own document, docs/design.md, "Packed documents": every step and
            the column pass take the local rows' starts). ``None``: dense over whole rows.
        groups: the ring's process groups (``new_ring_groups``); ring rank r holds layout shard r.
        layout: the token layout the shards were cut with.
        softmax_scale: defaults to ``1 / sqrt(D)``.
        return_lse: also return the lse ``[B, Hq, n]`` of the local rows (fp32, not differentiable).
        columns: ``"per_step"`` meets each column with the shard that holds it, inside the step's kernels;
            ``"gathered"`` all-reduces the index's few vertical columns' K/V once and spreads their work evenly
            over the steps (local query tile t at step t mod W). The work model (``benchmarks/ring_balance.py``)
            favours gathered at large W (per step, the sink columns' work falls on one rank), but its column
            pass is PyTorch matmuls over every column: on 2 H200s per-step is 3x faster, hence the default.
        check_index: validate the pattern first (a host sync; as in ``vertical_slash_attention``).
        trace: if given, each step's compute time on this rank is appended to it, and its work if ``trace.work``.
        layer: the model layer, named by a ``comm.CommTimeoutError`` of a transfer that passes its deadline
            (default: ``comm.current_layer()``); the groups' timeout is the deadline of every wait here.
        kv_exchange: how K/V moves inside ``groups.inner``: ``"ring"``, one hop per step, or ``"all_gather"``, the
            group's shards gathered and attended in one step per outer step (module docstring).

    Returns:
        out ``[B, n, Hq, D]`` in q's dtype (this rank's rows), and lse if ``return_lse``. The backward is
        bitwise-repeatable (deterministic kernels, a fixed ring order).
    """
    if groups.size != layout.world:
        raise ValueError(f"the ring has {groups.size} ranks but the layout was made for {layout.world}")
    if q.shape[1] != layout.local_len or k.shape[1] != layout.local_len or k.shape != v.shape:
        raise ValueError(
            f"q, k, v must be this rank's shard of {layout.local_len} tokens ([B, n, H, D]); got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[2] % k.shape[2] or q.shape[3] != k.shape[3] or q.shape[0] != k.shape[0]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree on B and D, and Hq % Hkv == 0")
    pattern = pattern or AttentionPattern(layout.seqlen)
    if pattern.seqlen != layout.seqlen:
        raise ValueError(
            f"the pattern is for rows of {pattern.seqlen} tokens but the layout's are {layout.seqlen}: the ring takes "
            "the whole rows' pattern (the same on every rank)"
        )
    pattern.check(q.shape[0], q.shape[2], q.device, "sparse_ring_attention's q (the whole rows, every rank)")
    index = pattern.index
    if index is None:
        index = VerticalSlashIndex.dense(q.shape[0], q.shape[2], layout.padded_len, layout.block_size, q.device)
    elif index.block_size != layout.block_size:
        raise ValueError(
            f"index.block_size={index.block_size} differs from the layout's block_size={layout.block_size}; "
            "make the layout with the sparse block size"
        )
    if check_index:
        pattern.validate()
    if columns not in ("gathered", "per_step"):
        raise ValueError(f"columns must be 'gathered' or 'per_step'; got {columns!r}")
    if kv_exchange not in ("ring", "all_gather"):
        raise ValueError(f"kv_exchange must be 'ring' or 'all_gather'; got {kv_exchange!r}")
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1], "sparse_ring_attention")
    schedule = _Schedule(groups, layout, q.device, current_layer(layer), kv_exchange)
    doc_start = pattern.starts_on(layout.positions_on(schedule.me, q.device), layout.padded_len)
    gather = columns == "gathered" and index.vertical.shape[-1] > 0
    # The index object itself, not its tensors: its cached kernel form (``VerticalSlashIndex.kernel_index``) then
    # serves every call on it, such as an activation checkpoint's recomputation.
    out, lse = SparseRingAttentionFunction.apply(q, k, v, index, scale, gather, schedule, trace, doc_start)
    return (out, lse) if return_lse else out

"""The index in the form the Triton kernels read, the tile maps of ring shards, and where one launch's tiles lie.

Plain PyTorch, no Triton: ``VerticalSlashIndex.kernel_index`` builds the kernel form here once and caches it on the
index, so the forward, the backward and every ring step of one index share one conversion.

Conversion (``prepare_index``; torch ops on the index's device, batched, no host sync): per (b, hq, query tile i)
the number of slash offsets ``<= i`` (``searchsorted``), per (b, hq, i) the number of columns ``< i * bs`` (the
prefix of the sorted column list a tile reads), the offset bitmap as int8. ``prepare_tile_map`` likewise for a
shard's tile map.

Shards (a ring step): q may be one shard of the global sequence and k/v another, each a list of whole tiles, local
tile ``t`` being global block ``blocks[t]`` (``q_blocks`` / ``kv_blocks``). The index stays global (converted for
the global length) and the call computes exactly the entries whose key lies in the k/v shard, so merging the calls
over every k/v shard gives the global result. The kernels take each shard's map both ways (``TileMap``: local ->
global block, global block -> local tile or -1) under a constexpr flag, so the one-device call (no maps) compiles to
the kernels without them; their column loops read each column's local row in the k/v shard (``column_rows``,
``replace_column_rows``) instead of looking its tile up. A row that meets no key in the shard gets (out 0, lse -inf),
which a merge leaves unchanged. A ring step's index keeps the whole index's bitmap and, in place of its lists, the
columns of the k/v shard (``replace_columns``), their local rows and the offsets that can reach it
(``replace_slash``), so its kernels walk only those.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:  # annotations only: importing the index here would close index -> backends -> triton -> here
    from ..index import VerticalSlashIndex


class KernelIndex(NamedTuple):
    """The index in the form the kernels read; all int32 / int8, contiguous, on the index's device.

    slash ``[B, Hq, Ks]`` offsets; scount ``[B, Hq, nb]`` number of offsets ``<= i``; columns ``[B, Hq, Kv']``
    (``Kv' = max(Kv, 1)``, padding -1); ccount ``[B, Hq, nb + 1]`` number of columns ``< i * bs``; offsets
    ``[B, Hq, nb]`` int8 bitmap of chosen offsets. ``nb = num_blocks`` tiles of the (global) sequence. A ring step's
    form walks a subset of the index (``slash`` / ``scount``, ``columns`` / ``ccount`` of the shard in hand) and masks
    with the whole ``offsets``. A step over several k/v shards (an all-gathered group) may also hold, per shard, the
    offsets its key tiles reach the q shard by: ``key_slash`` ``[G, B, Hq, Kg]`` (canonical, ``Kg`` the longest
    shard's list, about ``Ks / W`` on a striped ring), which the dk/dv pass walks (``replace_key_slash``; ``None``:
    ``slash`` / ``scount`` for every shard); the launcher counts them per key tile (``key_counts``).
    ``column_rows`` (same shape as ``columns``): with tile maps, each column's row in the k/v in hand, -1 where the
    column is padding or the k/v does not hold its block (``replace_column_rows``; ``None``: ``place`` computes it from
    the call's k/v map); the column loops read it instead of looking each column's tile up in the map.
    """

    slash: torch.Tensor
    scount: torch.Tensor
    columns: torch.Tensor
    ccount: torch.Tensor
    offsets: torch.Tensor
    block_size: int
    num_blocks: int
    key_slash: torch.Tensor | None = None
    column_rows: torch.Tensor | None = None

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(slash, scount, columns, ccount, offsets)``: what the custom ops take (``from_tensors`` inverts it)."""
        return self.slash, self.scount, self.columns, self.ccount, self.offsets

    @classmethod
    def from_tensors(
        cls,
        slash: torch.Tensor,
        scount: torch.Tensor,
        columns: torch.Tensor,
        ccount: torch.Tensor,
        offsets: torch.Tensor,
        block_size: int,
    ) -> KernelIndex:
        """The ``KernelIndex`` of ``tensors`` (the tile count is ``scount``'s last dimension)."""
        return cls(slash, scount, columns, ccount, offsets, block_size, scount.shape[-1])


def prepare_index(index: VerticalSlashIndex, seqlen: int) -> KernelIndex:
    """Convert a canonical ``VerticalSlashIndex`` for ``seqlen`` tokens (the global length when the calls run
    on shards); device ops only, no host sync. ``index.kernel_index(seqlen)`` is this, cached on the index."""
    bs, nb = index.block_size, index.num_blocks(seqlen)
    slash, scount = _slash_part(index.slash, nb)
    columns, ccount = _column_part(index.vertical, bs, nb)
    return KernelIndex(
        slash,
        scount,
        columns,
        ccount,
        index.offset_mask(seqlen).to(torch.int8).contiguous(),
        bs,
        nb,
    )


CHUNK_ELEMENTS = 1 << 26
"""Index entries that building a kernel form handles at once where its temporaries are int64: a gathered group's
per-shard offsets are sorted from ``G`` times the index (``parallel.ring.shard_index``), and at 4M tokens on 1024
shards that sort asked 16 GiB in one piece."""


def _slash_part(slash: torch.Tensor, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slash, scount)`` of a ``KernelIndex`` from canonical ``slash`` ``[B, Hq, Ks]`` (any integer dtype).

    The counts are a histogram of the offsets (padding and offsets past the last tile add nothing), summed in place,
    in int32 (a search per tile takes int64 tiles and counts)."""
    slash = slash.to(torch.int32).contiguous()
    scount = torch.zeros(*slash.shape[:2], nb, dtype=torch.int32, device=slash.device)
    counted = ((slash >= 0) & (slash < nb)).to(torch.int32)
    scount.scatter_add_(2, slash.clamp(0, nb - 1).long(), counted)
    return slash, scount.cumsum_(2)


def _column_part(vertical: torch.Tensor, bs: int, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(columns, ccount)`` of a ``KernelIndex`` from canonical ``vertical`` ``[B, Hq, Kv]``."""
    b, h = vertical.shape[:2]
    if vertical.shape[-1] == 0:
        vertical = torch.full((b, h, 1), -1, dtype=torch.long, device=vertical.device)
    vertical = vertical.contiguous()
    big = torch.iinfo(torch.int64).max
    starts = (torch.arange(nb + 1, device=vertical.device) * bs).expand(b, h, nb + 1).contiguous()
    ccount = torch.searchsorted(torch.where(vertical < 0, big, vertical), starts)
    return vertical.to(torch.int32), ccount.to(torch.int32)


def replace_columns(form: KernelIndex, vertical: torch.Tensor) -> KernelIndex:
    """``form`` with its column part built from canonical ``vertical`` ``[B, Hq, Kv]`` instead (a ring step's: the
    columns of the shard in hand, ``VerticalSlashIndex.keep_columns``), the slash part shared; device ops only."""
    columns, ccount = _column_part(vertical, form.block_size, form.num_blocks)
    return form._replace(columns=columns, ccount=ccount)


def replace_slash(form: KernelIndex, slash: torch.Tensor) -> KernelIndex:
    """``form`` with the offsets its kernels walk built from ``slash`` ``[B, Hq, Ks]`` instead (canonical: ascending,
    offset 0 first, -1 last; a ring step's: the offsets that reach the shard in hand, ``parallel.ring.shard_index``),
    the column part and the offset bitmap shared. The bitmap stays the whole index's: a column inside a tile of any
    chosen offset is attended as that tile, on whichever step holds it, so it is masked at every step. Device ops
    only."""
    slash, scount = _slash_part(slash, form.num_blocks)
    return form._replace(slash=slash, scount=scount)


def replace_key_slash(form: KernelIndex, per_shard: torch.Tensor) -> KernelIndex:
    """``form`` with the offsets its dk/dv pass walks from each k/v shard's key tiles: canonical ``per_shard``
    ``[G, B, Hq, Kg]`` (shard ``g`` of the call's k/v: the offsets that join its tiles to the q shard's;
    ``parallel.ring.shard_index``). From a key tile the union of a group's offsets reaches the q shard by one shard's
    only: walking the union would cost ``G`` times the walk. Device ops only."""
    return form._replace(key_slash=per_shard.to(torch.int32).contiguous())


def key_counts(
    key_slash: torch.Tensor, kv_blocks: torch.Tensor, last: torch.Tensor | None, num_blocks: int
) -> torch.Tensor:
    """int32 ``[G, B, Hq, T]``: for local key tile ``t`` of shard ``g`` of a call's k/v (global block ``gj =
    kv_blocks[g * T + t]``), how many of the shard's offsets ``key_slash[g]`` (``[G, B, Hq, Kg]``, canonical) reach
    a query tile that exists: ``o <= last[b, gj] - gj``. ``last`` ``[B, num_blocks]`` is each key block's last query
    tile that may reach it (documents: ``document_tiles.last_query_tiles``, -1 where none; ``None``: the last tile,
    ``num_blocks - 1``). The dk/dv pass walks offsets ``1 .. count - 1`` of a tile (offset 0, the diagonal, first).

    Per local key tile, not per global block as ``KernelIndex.scount``: a group of ``G`` shards' counts per global
    block were ``G`` times the index (4 GiB at 4M tokens on 1024 gathered shards); these are one index's. Device
    ops only: one search, each call (the bound moves with the documents)."""
    g, b, h = key_slash.shape[:3]
    gj = kv_blocks.long()
    if last is None:
        span = (num_blocks - 1 - gj).expand(b, -1)
    else:
        span = last.long()[:, gj] - gj  # [B, G * T]
    span = span.view(b, g, -1).transpose(0, 1)[:, :, None, :].expand(g, b, h, span.shape[-1] // g)
    big = torch.iinfo(torch.int32).max
    lists = torch.where(key_slash < 0, big, key_slash).contiguous()
    return torch.searchsorted(lists, span.to(torch.int32).contiguous(), right=True).to(torch.int32)


def narrow_columns(form: KernelIndex, width: int) -> KernelIndex:
    """``form`` with its column lists (and ``column_rows``) cut to their first ``width`` entries (at least one): a
    ring step's form lists its shard's columns first, the rest padding, so with ``width`` at least its longest list
    nothing is dropped, and the backward's column pass runs, and its buffer spans, the columns held rather than the
    whole index's list (``parallel.ring.column_widths``). Device ops only."""
    width = max(1, min(width, form.columns.shape[-1]))
    if width == form.columns.shape[-1]:
        return form
    rows = None if form.column_rows is None else form.column_rows[..., :width].contiguous()
    return form._replace(columns=form.columns[..., :width].contiguous(), column_rows=rows)


def replace_column_rows(form: KernelIndex, kv_map: TileMap) -> KernelIndex:
    """``form`` with ``column_rows`` for the k/v placed by ``kv_map``: each column's local row, ``tile * bs + col % bs``
    of its block's local tile, -1 where the column is padding or the k/v does not hold its block. A ring step builds
    it once with its index (``parallel.ring.shard_index``); device ops only."""
    bs, columns = form.block_size, form.columns
    tile = kv_map.tiles[columns.clamp(min=0).long() // bs]
    rows = torch.where((columns >= 0) & (tile >= 0), tile * bs + columns % bs, -1)
    return form._replace(column_rows=rows.to(torch.int32).contiguous())


class TileMap(NamedTuple):
    """Where a shard's tiles lie in the global sequence, both ways; int32, contiguous, on the shard's device.

    blocks ``[T]``: global block of local tile ``t``; tiles ``[num_blocks]``: local tile of global block ``g``,
    -1 where the shard does not hold it.
    """

    blocks: torch.Tensor
    tiles: torch.Tensor


def prepare_tile_map(blocks: torch.Tensor, num_blocks: int) -> TileMap:
    """The ``TileMap`` of a shard whose local tile ``t`` is global block ``blocks[t]`` (integer ``[T]``,
    distinct, each ``< num_blocks``, e.g. ``Layout.block_ids``); device ops only, no host sync."""
    tiles = torch.full((num_blocks,), -1, dtype=torch.int32, device=blocks.device)
    tiles[blocks.long()] = torch.arange(blocks.numel(), dtype=torch.int32, device=blocks.device)
    return TileMap(blocks.to(torch.int32).contiguous(), tiles)


BlockMap = torch.Tensor | TileMap | None  # a shard's global block per local tile (``q_blocks`` / ``kv_blocks``)


def place(
    index: VerticalSlashIndex | KernelIndex, n: int, q_blocks: BlockMap, kv_blocks: BlockMap, n_kv: int | None = None
) -> tuple[KernelIndex, TileMap | None, TileMap | None]:
    """The kernel index of a launch on ``n``-token q and ``n_kv``-token k/v (default ``n``), and its tile maps (both
    None: one device, where ``n_kv`` must be ``n``; k/v of another length are shards placed by ``kv_blocks``, such as
    a ring step's all-gathered inner group).

    A ``VerticalSlashIndex`` gives its cached kernel form (``kernel_index``). With maps the index covers the
    global blocks: a ``KernelIndex``'s ``num_blocks``, else a given ``TileMap``'s length, else the highest block
    in the maps + 1 (a host sync: pass a ``KernelIndex`` or ``TileMap`` to avoid it). A missing map is the
    identity. With maps the returned index has ``column_rows``: a given ``KernelIndex``'s own (which must be for
    this k/v map), else computed here from the k/v map (``replace_column_rows``), so every mapped call runs the
    same kernels.
    """
    bs, tiles = index.block_size, -(-n // index.block_size)
    n_kv = n if n_kv is None else n_kv
    if q_blocks is None and kv_blocks is None:
        if n_kv != n:
            raise ValueError(
                f"q has {n} tokens but k/v {n_kv}: k/v of another length are shards; place them with kv_blocks"
            )
        kidx = index if isinstance(index, KernelIndex) else index.kernel_index(n)
        if kidx.num_blocks != tiles:
            raise ValueError(
                f"the KernelIndex has {kidx.num_blocks} tiles but q and k/v have {tiles}; prepare it for the same "
                "length, or pass q_blocks / kv_blocks to place shards in a longer sequence"
            )
        return kidx, None, None
    if n % bs or n_kv % bs:
        raise ValueError(
            f"q_blocks / kv_blocks need shards of whole tiles: {n} (q) and {n_kv} (k/v) tokens must be multiples of "
            f"{bs}"
        )
    device = index.slash.device
    if isinstance(index, KernelIndex):
        nb = index.num_blocks
    elif isinstance(q_blocks, TileMap) or isinstance(kv_blocks, TileMap):
        nb = (q_blocks if isinstance(q_blocks, TileMap) else kv_blocks).tiles.shape[0]
    else:
        nb = int(max(tiles - 1 if m is None else m.max() for m in (q_blocks, kv_blocks))) + 1
    maps = []
    for name, m, tiles in (("q_blocks", q_blocks, tiles), ("kv_blocks", kv_blocks, n_kv // bs)):
        if m is None:
            m = torch.arange(tiles, device=device)
        if not isinstance(m, TileMap):
            m = prepare_tile_map(m.to(device), nb)
        if m.blocks.shape != (tiles,) or m.tiles.shape != (nb,) or m.blocks.device != device:
            raise ValueError(
                f"{name}: expected a map of {tiles} local tiles into {nb} global blocks on {device}; got blocks "
                f"{tuple(m.blocks.shape)}, tiles {tuple(m.tiles.shape)} on {m.blocks.device}"
            )
        maps.append(m)
    kidx = index if isinstance(index, KernelIndex) else index.kernel_index(nb * bs)
    if kidx.column_rows is None:
        kidx = replace_column_rows(kidx, maps[1])
    elif (
        kidx.column_rows.shape != kidx.columns.shape
        or kidx.column_rows.dtype != torch.int32
        or kidx.column_rows.device != device
        or not kidx.column_rows.is_contiguous()
    ):
        raise ValueError(
            f"column_rows must be int32, contiguous, shaped like columns {tuple(kidx.columns.shape)} on {device}; got "
            f"{kidx.column_rows.dtype} {tuple(kidx.column_rows.shape)} on {kidx.column_rows.device}"
        )
    return kidx, maps[0], maps[1]

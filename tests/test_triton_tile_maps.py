"""Triton kernels on pairs of ring shards (tile maps) against the PyTorch path and the float64 reference.

A ring step runs the kernels on (this rank's queries, one rank's K/V shard) with the global index. For every
(query shard, K/V shard) pair of a layout — the diagonal pair, pairs whose shards interleave, and (contiguous)
a pair with no causal work — the Triton forward (merged into a running out/lse) and backward must match
``torch_path`` on the same maps, and the merge over all K/V shards (out, lse, dq) and the sum over all query
shards (dk, dv) must match the float64 reference on the whole sequence, cut with the layout. fp32: near fp32
rounding; fp16: a small multiple of the same reference computed in fp16 by PyTorch. CPU: the Triton
interpreter (``conftest.py``), so shapes are small.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from distributed import run_distributed
from test_triton_kernels import DEVICE, make_inputs, max_err, random_index, reference

from ds_mtraining.parallel.comm import new_ring_groups
from ds_mtraining.parallel.layout import make_layout
from ds_mtraining.parallel.ring import column_widths, shard_index
from ds_mtraining.parallel.work import offset_shards, offsets_reaching
from ds_mtraining.sparse import AttentionPattern, VerticalSlashIndex, torch_path, vertical_slash_attention
from ds_mtraining.sparse.triton import (
    backward_delta,
    launch_config,
    prepare_index,
    prepare_tile_map,
    replace_column_rows,
    vertical_slash_backward,
    vertical_slash_forward,
)
from ds_mtraining.sparse.triton.kernel_index import key_counts, narrow_columns

BS = 64
# Rows that meet no key of a shard get lse = log(0) = -inf by design; the interpreter evaluates the kernels with
# numpy, which warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


def _moved(index: VerticalSlashIndex, device) -> VerticalSlashIndex:
    return VerticalSlashIndex(index.vertical.to(device), index.slash.to(device), index.block_size)


def _step_forms(index: VerticalSlashIndex, kidx, layout, rank: int, maps: list) -> list:
    """What a ring step of ``rank`` over each K/V shard runs (``ring.shard_index``, as ``StepKernels`` builds it):
    the shard's own columns, their rows in the shard (``maps``: each shard's ``TileMap``) and only the offsets that
    reach it, by shard."""
    owner = layout.block_owner_on(index.device)
    reach = offset_shards(layout, rank, index.device)
    return [shard_index(index, owner, range(kr, kr + 1), kidx, reach, maps[kr]) for kr in range(layout.world)]


def _assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Equal -inf patterns (rows that met no key) and max |got - want| <= tol elsewhere."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert torch.isfinite(got[~torch.isneginf(want)]).all(), f"{name}: not finite"
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"{name}: rows with no key differ"
    empty = torch.isneginf(want)
    err = max_err(got.masked_fill(empty, 0.0), want.masked_fill(empty, 0.0))
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g}"


CASES = [
    # layout, W, seqlen (padded to the layout), B, dtype
    pytest.param("striped", 2, 500, 2, torch.float32, id="striped-W2-fp32"),
    pytest.param("striped", 3, 448, 1, torch.float32, id="striped-W3-uneven-fp32"),
    pytest.param("striped", 4, 900, 1, torch.float32, id="striped-W4-uneven-fp32"),
    pytest.param("zigzag", 2, 512, 1, torch.float32, id="zigzag-W2-fp32"),
    pytest.param("zigzag", 3, 384, 1, torch.float32, id="zigzag-W3-fp32"),
    pytest.param("contiguous", 2, 256, 1, torch.float32, id="contiguous-W2-no-causal-pair-fp32"),
    pytest.param("striped", 2, 512, 1, torch.float16, id="striped-W2-fp16"),
]


@pytest.mark.parametrize("kind, world, seqlen, b, dtype", CASES)
def test_shard_pairs_match_torch_path_and_reference(kind, world, seqlen, b, dtype):
    """A lone call on the whole index, then the merged forward and the backward of every pair on what the ring's step
    runs (the shard's columns and the offsets that reach it: an offset in another step's list drops its tiles)."""
    hq, hkv, d = 2, 1, 64
    gen = torch.Generator().manual_seed(seqlen + world)
    layout = make_layout(kind, world, seqlen, block_size=BS)
    n = layout.padded_len
    q, k, v = make_inputs(b, n, hq, hkv, d, dtype, gen)
    do = torch.randn(q.shape, generator=gen).to(DEVICE, dtype)
    index = _moved(random_index(b, hq, seqlen, BS, num_cols=24, num_offsets=8, gen=gen), DEVICE)
    scale = d**-0.5
    kidx = prepare_index(index, n)  # the global index, prepared once for every pair
    blocks = [layout.block_ids(r).to(DEVICE) for r in range(world)]
    maps = [prepare_tile_map(x, kidx.num_blocks) for x in blocks]
    steps = [_step_forms(index, kidx, layout, r, maps) for r in range(world)]
    shard = [[layout.shard(x, r) for r in range(world)] for x in (q, k, v, do)]
    qs, ks, vs, dos = shard

    on_cpu = (q.cpu(), k.cpu(), v.cpu(), _moved(index, "cpu"), scale, do.cpu())
    ref = reference(*on_cpu, torch.float64)
    if dtype == torch.float32:
        # The interpreter computes fp32 dots exactly in fp32; on a GPU Triton runs them as tf32.
        limits = [(2e-5 if DEVICE == "cpu" else 1e-2) * (1.0 + r.abs().max().item()) for r in ref]
    else:
        base = reference(*on_cpu, dtype)
        limits = [3.0 * max_err(bl, r) + 1e-4 for bl, r in zip(base, ref)]
    lim_out, lim_lse, lim_dq, lim_dk, lim_dv = limits
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = ref

    outs, lses = [], []
    for r in range(world):
        # One call on its own: rows that meet no key of the shard come back (0, -inf), like the PyTorch path.
        first = (r + 1) % world
        got = vertical_slash_forward(qs[r], ks[first], vs[first], kidx, scale, q_blocks=maps[r], kv_blocks=maps[first])
        want = torch_path.vertical_slash_forward(
            qs[r], ks[first], vs[first], index, scale, q_blocks=blocks[r], kv_blocks=blocks[first]
        )
        _assert_close(f"out q{r} kv{first} alone", got[0], want[0], lim_out)
        _assert_close(f"lse q{r} kv{first} alone", got[1], want[1], lim_lse)

        # Merged over every K/V shard, the diagonal pair last, so the first merges can start from empty rows.
        out = torch.zeros(b, layout.local_len, hq, d, device=DEVICE)
        lse = torch.full((b, hq, layout.local_len), float("-inf"), device=DEVICE)
        out_t, lse_t = out.clone(), lse.clone()
        for s in range(world):
            kr = (r + 1 + s) % world
            vertical_slash_forward(
                qs[r], ks[kr], vs[kr], steps[r][kr], scale, out=out, lse=lse, q_blocks=maps[r], kv_blocks=maps[kr]
            )
            torch_path.vertical_slash_forward(
                qs[r], ks[kr], vs[kr], index, scale, out=out_t, lse=lse_t, q_blocks=blocks[r], kv_blocks=blocks[kr]
            )
            _assert_close(f"running out q{r} after kv{kr}", out, out_t, lim_out)
            _assert_close(f"running lse q{r} after kv{kr}", lse, lse_t, lim_lse)
        _assert_close(f"out q{r} vs reference", out, layout.shard(ref_out, r), lim_out)
        _assert_close(f"lse q{r} vs reference", lse, layout.shard(ref_lse, r, dim=2), lim_lse)
        outs.append(out.to(dtype))
        lses.append(lse)

    dq = [torch.zeros(x.shape, dtype=torch.float64) for x in qs]
    dk = [torch.zeros(x.shape, dtype=torch.float64) for x in ks]
    dv = [torch.zeros(x.shape, dtype=torch.float64) for x in vs]
    for r in range(world):
        for kr in range(world):
            args = (dos[r], qs[r], ks[kr], vs[kr], outs[r], lses[r])
            got = vertical_slash_backward(*args, steps[r][kr], scale, q_blocks=maps[r], kv_blocks=maps[kr])
            want = torch_path.vertical_slash_backward(*args, index, scale, q_blocks=blocks[r], kv_blocks=blocks[kr])
            for name, x, y, lim in zip(("dq", "dk", "dv"), got, want, (lim_dq, lim_dk, lim_dv)):
                assert x.dtype == dtype
                _assert_close(f"{name} q{r} kv{kr}", x, y, lim)
            dq[r] += got[0].cpu().double()
            dk[kr] += got[1].cpu().double()
            dv[kr] += got[2].cpu().double()
    for r in range(world):
        _assert_close(f"dq q{r} vs reference", dq[r], layout.shard(ref_dq, r), lim_dq)
        _assert_close(f"dk kv{r} vs reference", dk[r], layout.shard(ref_dk, r), lim_dk)
        _assert_close(f"dv kv{r} vs reference", dv[r], layout.shard(ref_dv, r), lim_dv)


@pytest.mark.parametrize("kind, world, seqlen, b, dtype", [CASES[0], CASES[6]])
def test_shard_pairs_with_the_column_pass_split_over_query_tiles(monkeypatch, kind, world, seqlen, b, dtype):
    """The pairs above run one column-pass program per chunk (a shard's few query tiles); long shards split each
    chunk's tiles over several programs (``launch_config.column_splits``), whose planes the dk/dv pass sums: forced."""
    monkeypatch.setattr(launch_config, "COL_SPLIT_TILES", 1)
    test_shard_pairs_match_torch_path_and_reference(kind, world, seqlen, b, dtype)

@pytest.mark.parametrize(
    ("kind", "world", "n", "stripe", "split"),
    [("striped", 2, 512, None, False), ("striped", 3, 576, None, False), ("striped", 4, 768, None, False),
     ("striped", 2, 768, 128, False), ("zigzag", 3, 768, None, False), ("contiguous", 2, 512, None, False),
     # the split column pass on the layouts whose shards hold the fewest columns a step (CI time: one case a layout)
     ("striped", 4, 768, None, True), ("zigzag", 3, 768, None, True), ("striped", 2, 768, 128, True)],
)  # fmt: skip
def test_a_steps_own_columns_and_offsets_give_the_pairs_result(monkeypatch, kind, world, n, stripe, split):
    """A ring step's index keeps only the columns of the K/V shard in hand and the offsets that reach it
    (``shard_index``): every pair's forward and backward equal the whole index's (by the PyTorch path). Striped with
    one block a stripe, the offsets kept are exactly one residue class, ``o = r - s (mod W)``, and offset 0; the bitmap
    stays shared. The backward runs, as the ring's, on the step's column lists cut to ``column_widths``
    (``narrow_columns``), whose bound holds every list; ``split``: the column pass splits its query tiles to fill the
    GPU, as a ring step's few columns make it (here forced: few tiles)."""
    if split:
        monkeypatch.setattr(launch_config, "COL_SPLIT_MIN_TILES", 1)
    gen = torch.Generator().manual_seed(3 + world)
    hq, d = 2, 64
    layout = make_layout(kind, world, n, block_size=BS, stripe=stripe)
    q, k, v = make_inputs(1, n, hq, 1, d, torch.float32, gen)
    do = torch.randn(q.shape, generator=gen).to(DEVICE)
    index = _moved(random_index(1, hq, n, BS, num_cols=40, num_offsets=10, gen=gen), DEVICE)
    kidx = prepare_index(index, n)
    maps = [prepare_tile_map(layout.block_ids(r).to(DEVICE), kidx.num_blocks) for r in range(world)]
    qs, ks, vs, dos = ([layout.shard(x, r) for r in range(world)] for x in (q, k, v, do))
    widths = column_widths(index, layout.block_owner_on(index.device), world).tolist()
    for r in range(world):
        steps = _step_forms(index, kidx, layout, r, maps)
        for kr in range(world):
            step = steps[kr]
            narrowed = narrow_columns(step, widths[kr])
            assert int((step.columns >= 0).sum(-1).max()) == widths[kr]  # one shard: the bound is the longest list
            assert narrowed.columns.shape[-1] == max(1, widths[kr]) < step.columns.shape[-1]
            assert torch.equal(narrowed.columns, step.columns[..., : narrowed.columns.shape[-1]])
            assert step.offsets is kidx.offsets
            assert int((step.columns >= 0).sum()) < int((index.vertical >= 0).sum())
            assert torch.equal(step.column_rows >= 0, step.columns >= 0)  # the shard holds every column it keeps
            if kind == "striped" and stripe is None:  # offsets past the rank's last tile reach no tile: dropped
                kept = [[o for o in row if o >= 0] for row in step.slash.flatten(0, 1).tolist()]
                last = int(layout.block_ids(r).max())
                residue = [[o for o in row if o == 0 or 0 < o <= last and (o - r + kr) % world == 0]
                           for row in index.slash.flatten(0, 1).tolist()]  # fmt: skip
                assert kept == residue, (r, kr)
            pair = {"q_blocks": maps[r], "kv_blocks": maps[kr]}
            # The whole index's pair by the PyTorch path (the Triton kernels on it: the test of the shard pairs above;
            # on the interpreter they would double this test's time).
            blocks = {"q_blocks": layout.block_ids(r).to(DEVICE), "kv_blocks": layout.block_ids(kr).to(DEVICE)}
            running = [torch.zeros(qs[r].shape, device=DEVICE), torch.full((1, hq, layout.local_len), -torch.inf,
                                                                           device=DEVICE)]  # fmt: skip
            got = list(vertical_slash_forward(qs[r], ks[kr], vs[kr], step, 0.125, out=running[0].clone(),
                                              lse=running[1].clone(), **pair))  # fmt: skip
            whole = list(torch_path.vertical_slash_forward(qs[r], ks[kr], vs[kr], index, 0.125, **blocks))
            if not torch.isfinite(whole[1]).any():
                continue
            lse = torch.where(torch.isneginf(whole[1]), 0.0, whole[1])  # rows with no key: any finite lse
            args = (dos[r], qs[r], ks[kr], vs[kr], whole[0], lse)
            got += vertical_slash_backward(*args, narrowed, 0.125, **pair)
            whole += torch_path.vertical_slash_backward(*args, index, 0.125, **blocks)
            for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, whole):
                _assert_close(f"{name} q{r} kv{kr}", x, y, (2e-5 if DEVICE == "cpu" else 1e-2) * (1 + y.abs().max()))


def test_shards_holding_the_same_blocks_at_different_local_tiles():
    """Maps in general (not a ring layout's): both shards hold global blocks 1, 2, 4, in different local
    order, so every diagonal tile is present with its key tile elsewhere than its query tile."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = make_inputs(1, 192, 2, 1, 64, torch.float32, gen)
    do = torch.randn(q.shape, generator=gen).to(DEVICE)
    index = _moved(random_index(1, 2, 320, BS, num_cols=24, num_offsets=3, gen=gen), DEVICE)
    q_blocks, kv_blocks = torch.tensor([4, 1, 2], device=DEVICE), torch.tensor([2, 4, 1], device=DEVICE)
    got = list(vertical_slash_forward(q, k, v, index, 0.125, q_blocks=q_blocks, kv_blocks=kv_blocks))
    want = list(torch_path.vertical_slash_forward(q, k, v, index, 0.125, q_blocks=q_blocks, kv_blocks=kv_blocks))
    args = (do, q, k, v, want[0], want[1], index, 0.125)
    got += vertical_slash_backward(*args, q_blocks=q_blocks, kv_blocks=kv_blocks)
    want += torch_path.vertical_slash_backward(*args, q_blocks=q_blocks, kv_blocks=kv_blocks)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        _assert_close(name, x, y, (2e-5 if DEVICE == "cpu" else 1e-2) * (1.0 + y.abs().max().item()))


def test_column_rows_place_each_column_in_the_shard():
    """``replace_column_rows``: a column's row in the k/v shard, -1 where padding or its block is not held."""
    form = prepare_index(VerticalSlashIndex.build(torch.tensor([[[3, 70, 130, -1]]]), torch.tensor([[[0]]]), BS), 192)
    rows = replace_column_rows(form, prepare_tile_map(torch.tensor([2, 0]), 3)).column_rows
    assert rows.dtype == torch.int32 and rows.tolist() == [[[BS + 3, -1, 130 - 2 * BS, -1]]]


def test_the_kernels_read_each_columns_row_from_the_index():
    """With maps the column loops of the forward, the dq and the column passes read each column's row in the k/v
    shard from ``column_rows``: the ring's precomputed rows and the launcher's own give the PyTorch path's result,
    rows one off (the shard's next row) another one in every output. Striped W 2, q of rank 1 against k/v of rank 0:
    the whole index's columns fall in both shards."""
    gen = torch.Generator().manual_seed(13)
    layout = make_layout("striped", 2, 512, block_size=BS)
    q, k, v = make_inputs(1, 512, 2, 1, 64, torch.float32, gen)
    do = torch.randn(q.shape, generator=gen).to(DEVICE)
    index = _moved(random_index(1, 2, 512, BS, num_cols=40, num_offsets=3, gen=gen), DEVICE)
    kidx = prepare_index(index, 512)
    blocks = [layout.block_ids(r).to(DEVICE) for r in range(2)]
    maps = [prepare_tile_map(x, kidx.num_blocks) for x in blocks]
    qs, ks, vs, dos = (layout.shard(x, r) for x, r in ((q, 1), (k, 0), (v, 0), (do, 1)))
    whole = replace_column_rows(kidx, maps[0]).column_rows
    assert (whole >= 0).any() and ((whole < 0) & (kidx.columns >= 0)).any()  # columns held and not held
    step = _step_forms(index, kidx, layout, 1, maps)[0]
    off = step._replace(column_rows=torch.where(step.column_rows >= 0, (step.column_rows + 1) % layout.local_len, -1))
    pair = {"q_blocks": maps[1], "kv_blocks": maps[0]}
    want = list(torch_path.vertical_slash_forward(qs, ks, vs, index, 0.125, q_blocks=blocks[1], kv_blocks=blocks[0]))
    lse = torch.where(torch.isneginf(want[1]), 0.0, want[1])  # rows with no key: any finite lse
    args = (dos, qs, ks, vs, want[0], lse)
    want += torch_path.vertical_slash_backward(*args, index, 0.125, q_blocks=blocks[1], kv_blocks=blocks[0])
    for form, right in ((kidx, True), (step, True), (off, False)):
        got = list(vertical_slash_forward(qs, ks, vs, form, 0.125, **pair))
        got += vertical_slash_backward(*args, form, 0.125, **pair)
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            tol = (2e-5 if DEVICE == "cpu" else 1e-2) * (1.0 + y.abs().max().item())
            if right:
                _assert_close(name, x, y, tol)
            else:
                assert max_err(x.masked_fill(torch.isneginf(y), 0.0), y.masked_fill(torch.isneginf(y), 0.0)) > tol, name


def test_block_ids_or_tile_maps_give_the_same_result():
    """Plain block ids (maps built per call, a host sync for the global length) equal prepared tile maps."""
    gen = torch.Generator().manual_seed(7)
    layout = make_layout("striped", 2, 256, block_size=BS)
    q, k, v = make_inputs(1, 256, 2, 1, 64, torch.float32, gen)
    index = _moved(random_index(1, 2, 256, BS, num_cols=12, num_offsets=2, gen=gen), DEVICE)
    kidx = prepare_index(index, 256)
    q0, k1, v1 = layout.shard(q, 0), layout.shard(k, 1), layout.shard(v, 1)
    b0, b1 = (layout.block_ids(r).to(DEVICE) for r in (0, 1))
    by_map = vertical_slash_forward(
        q0, k1, v1, kidx, 0.125, q_blocks=prepare_tile_map(b0, 4), kv_blocks=prepare_tile_map(b1, 4)
    )
    by_ids = vertical_slash_forward(q0, k1, v1, index, 0.125, q_blocks=b0, kv_blocks=b1)
    assert torch.equal(by_map[0], by_ids[0]) and torch.equal(by_map[1], by_ids[1])


def test_rejects_inconsistent_maps():
    q = torch.zeros(1, 128, 1, 64, device=DEVICE)
    index = _moved(VerticalSlashIndex.dense(1, 1, 256, BS), DEVICE)
    kidx = prepare_index(index, 256)
    with pytest.raises(ValueError, match="map of 2 local tiles into 4 global blocks"):
        vertical_slash_forward(q, q, q, kidx, 1.0, q_blocks=prepare_tile_map(torch.arange(2, device=DEVICE), 3))
    with pytest.raises(ValueError, match="KernelIndex has 4 tiles but q and k/v have 2"):
        vertical_slash_forward(q, q, q, kidx, 1.0)
    with pytest.raises(ValueError, match="whole tiles"):
        vertical_slash_forward(q[:, :100], q[:, :100], q[:, :100], kidx, 1.0, q_blocks=torch.arange(2))
    wrong = kidx._replace(column_rows=torch.zeros(kidx.columns.shape[-1] + 1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="column_rows must be int32, contiguous, shaped like columns"):
        vertical_slash_forward(q, q, q, wrong, 1.0, q_blocks=torch.arange(2, device=DEVICE))


def _triton_ring_worker(rank: int, world: int, inner_size: int | None, kv_exchange: str) -> None:
    from ds_mtraining.parallel import ring
    from ds_mtraining.sparse import triton as triton_backend
    from ds_mtraining.sparse.triton import kernel_index

    # The ring picks Triton for CUDA tensors; here CPU tensors run it through the interpreter instead.
    ring.kernel_backend = lambda q: triton_backend
    # Count the conversions wherever they are called from (the ring, the index's cache, or a launcher given block ids).
    conversions = {"prepare_index": 0, "prepare_tile_map": 0}

    def counting(name: str):
        convert = getattr(kernel_index, name)

        def counted(*args):
            conversions[name] += 1
            return convert(*args)

        return counted

    for name in conversions:
        setattr(kernel_index, name, counting(name))
        setattr(triton_backend, name, getattr(kernel_index, name))
    # Each backward step's column lists as the ring cuts them: (longest list, width before, width after).
    cuts = []
    narrow = kernel_index.narrow_columns

    def recorded(form, width):
        cut = narrow(form, width)
        cuts.append((int((form.columns >= 0).sum(-1).max()), form.columns.shape[-1], cut.columns.shape[-1]))
        return cut

    kernel_index.narrow_columns = recorded
    groups = new_ring_groups(list(range(world)), inner_size)
    gen = torch.Generator().manual_seed(11)
    b, n, hq, hkv, d = 1, 448, 2, 1, 64
    q, k, v, dout = (torch.randn(b, n, h, d, generator=gen) for h in (hq, hkv, hkv, hq))
    index = random_index(b, hq, n, BS, num_cols=16, num_offsets=5, gen=gen)
    pattern = AttentionPattern(n, index)  # the whole rows'; the ring converts its index
    layout = make_layout("striped", world, n, block_size=BS)
    me = groups.rank
    # One conversion per index, cached on it: "gathered" steps run a fresh copy without the columns, the first
    # "per_step" call converts ``index`` itself and the second reuses that.
    # Forward and backward together: one tile map per ring rank, or (all-gather) this rank's and one per inner group.
    maps = world if kv_exchange == "ring" else 1 + world // (inner_size or world)
    for columns, converted in (("gathered", 1), ("per_step", 1), ("per_step", 0)):
        leaves = [layout.shard(x, me).requires_grad_() for x in (q, k, v)]
        out, lse = ring.sparse_ring_attention(
            *leaves, pattern, groups=groups, layout=layout, return_lse=True, columns=columns, kv_exchange=kv_exchange
        )
        grads = torch.autograd.grad(out, leaves, layout.shard(dout, me))
        assert conversions == {"prepare_index": converted, "prepare_tile_map": maps}, (columns, conversions)
        conversions.update(prepare_index=0, prepare_tile_map=0)
        # Every step with work cut its lists once, keeping every listed column; passed shards hold a few of the 16.
        assert cuts and all(listed <= after <= before for listed, before, after in cuts), cuts
        if columns == "per_step" and kv_exchange == "ring":
            assert all(after < before for _, before, after in cuts), cuts
        cuts.clear()
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        ref_out, ref_lse = vertical_slash_attention(*full, pattern, return_lse=True)  # PyTorch path (CPU)
        ref_grads = torch.autograd.grad(ref_out, full, dout)
        real = layout.positions(me) < n
        tol = {"atol": 2e-5, "rtol": 1e-5}
        torch.testing.assert_close(out[:, real], layout.shard(ref_out, me)[:, real].detach(), **tol)
        torch.testing.assert_close(lse[..., real], layout.shard(ref_lse, me, dim=2)[..., real], **tol)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, layout.shard(want, me), **tol)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="runs Triton on CPU tensors through the interpreter (CPU-only machines); tests/gpu/test_gpu_ring.py covers "
    "the ring on GPUs",
)
@pytest.mark.parametrize(
    ("world", "inner_size", "kv_exchange"),
    [(3, None, "ring"), (4, 2, "ring"), (3, None, "all_gather"), (4, 2, "all_gather")],
    ids=["flat-3", "hierarchical-2x2", "flat-3-all-gather", "hierarchical-2x2-all-gather"],
)
def test_ring_runs_the_triton_kernels(world, inner_size, kv_exchange):
    """The ring's Triton wiring (index prepared for the padded length, tile maps, each step's own columns and
    offsets, reuse in the backward, its column lists cut for the backward, gathered columns on the PyTorch path) on a
    real gloo ring of 3 (uneven striped)
    and a hierarchical one of 2 x 2, K/V passed by the ring or all-gathered in the inner group, against one device."""
    run_distributed(world, _triton_ring_worker, inner_size, kv_exchange, timeout=300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("backend", ["triton", "torch_path"])
def test_a_steps_backward_adds_into_the_rings_buffers(backend, dtype):
    """What a ring step's backward shares with its ring: the rows' delta computed once (``backward_delta``), a running
    fp32 dq it adds into and a fp32 dK/dV buffer it writes. The same call without them gives the reference: dq added to
    the running one and dk / dv exactly as the call gives them (rounded once, to the input dtype, where it is fp16);
    the running dq's rows that the step does not reach are left as they were; buffers of the wrong dtype, shape or
    strides are refused."""
    world, r, kr = 3, 2, 1
    hq, hkv, d = 4, 2, 64
    gen = torch.Generator().manual_seed(31)
    layout = make_layout("striped", world, 9 * BS, block_size=BS)
    q, k, v = make_inputs(1, layout.padded_len, hq, hkv, d, dtype, gen)
    do = torch.randn(q.shape, generator=gen).to(DEVICE, dtype)
    index = _moved(random_index(1, hq, layout.padded_len, BS, num_cols=24, num_offsets=6, gen=gen), DEVICE)
    qs, ks, vs, dos = (layout.shard(x, s) for x, s in ((q, r), (k, kr), (v, kr), (do, r)))
    if backend == "triton":
        kidx = prepare_index(index, layout.padded_len)
        maps = [prepare_tile_map(layout.block_ids(s).to(DEVICE), kidx.num_blocks) for s in range(world)]
        step = _step_forms(index, kidx, layout, r, maps)[kr]
        call, delta_of, pair = vertical_slash_backward, backward_delta, {"q_blocks": maps[r], "kv_blocks": maps[kr]}
    else:
        step, call, delta_of = index, torch_path.vertical_slash_backward, torch_path.backward_delta
        pair = {"q_blocks": layout.block_ids(r).to(DEVICE), "kv_blocks": layout.block_ids(kr).to(DEVICE)}
    out = torch.randn(qs.shape, generator=gen).to(DEVICE, dtype)
    lse = torch.randn(1, hq, qs.shape[1], generator=gen).to(DEVICE).abs() + 3.0
    args = (dos, qs, ks, vs, out, lse, step, d**-0.5)
    want_dq, want_dk, want_dv = call(*args, **pair)
    running = torch.randn(qs.shape, generator=gen, dtype=torch.float32).to(DEVICE)
    before = running.clone()
    dkv = torch.full((2, *ks.shape), float("nan"), device=DEVICE)
    got_dq, got_dk, got_dv = call(*args, **pair, delta=delta_of(dos, out), dq=running, dkv=dkv)
    assert got_dq is running and got_dk.data_ptr() == dkv[0].data_ptr() and got_dv.data_ptr() == dkv[1].data_ptr()
    assert got_dk.dtype == got_dv.dtype == torch.float32
    if backend == "triton" or DEVICE == "cpu":
        assert torch.equal(got_dk.to(dtype), want_dk) and torch.equal(got_dv.to(dtype), want_dv)
    else:  # cuBLAS may take another algorithm for a product written into a strided buffer: fp32 rounding apart
        for name, got, want in (("dk", got_dk, want_dk), ("dv", got_dv, want_dv)):
            _assert_close(name, got.to(dtype), want, 1e-5 * (1.0 + want.abs().max().item()))
    # The kernel adds its fp32 rows: equal to adding the fp32 call's dq; the fp16 call rounds its dq once more.
    tol = 0.0 if dtype == torch.float32 else 2e-3 * (1.0 + want_dq.abs().max().item())
    _assert_close("running dq", running, before + want_dq.float(), tol)
    reached = want_dq.abs().amax(dim=(0, 2, 3)) > 0
    assert reached.any() and torch.equal(running[:, ~reached], before[:, ~reached])
    with pytest.raises(ValueError, match="dq must be"):
        call(*args, **pair, dq=running.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="dkv must be"):
        call(*args, **pair, dkv=dkv.to(torch.float64))
    with pytest.raises(ValueError, match="delta must be"):
        call(*args, **pair, delta=delta_of(dos, out)[:, :1])


@pytest.mark.parametrize(
    ("kind", "world", "n", "group"),
    [("striped", 4, 768, 2), ("striped", 3, 576, 3), ("zigzag", 4, 512, 2), ("contiguous", 2, 512, 2)],
)
def test_a_step_over_gathered_shards_gives_their_pairs_result(kind, world, n, group):
    """An all-gathered inner group's step: k/v of ``group`` consecutive ranks' shards, ``group`` times q's length,
    placed by one tile map, with the index of those shards (``shard_index`` over the range). Forward and backward equal
    the PyTorch path on the same inputs; merged over the groups, out / lse / dq equal the float64 reference, and each
    shard's slice of the groups' dk / dv summed over the query ranks equals the reference's."""
    gen = torch.Generator().manual_seed(7 + world)
    hq, hkv, d = 4, 2, 64
    layout = make_layout(kind, world, n, block_size=BS)
    q, k, v = make_inputs(1, n, hq, hkv, d, torch.float32, gen)
    do = torch.randn(q.shape, generator=gen).to(DEVICE)
    index = _moved(random_index(1, hq, n, BS, num_cols=40, num_offsets=10, gen=gen), DEVICE)
    scale = d**-0.5
    kidx = prepare_index(index, n)
    owner = layout.block_owner_on(DEVICE)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference(
        q.cpu(), k.cpu(), v.cpu(), _moved(index, "cpu"), scale, do.cpu(), torch.float64
    )
    tol = (2e-5 if DEVICE == "cpu" else 1e-2) * (1.0 + ref_dq.abs().max().item())
    qs, ks, vs, dos = ([layout.shard(x, r) for r in range(world)] for x in (q, k, v, do))
    groups = [range(g, g + group) for g in range(0, world, group)]
    dk = [torch.zeros(x.shape, dtype=torch.float64) for x in ks]
    dv = [torch.zeros(x.shape, dtype=torch.float64) for x in vs]
    for r in range(world):
        q_map = prepare_tile_map(layout.block_ids(r).to(DEVICE), kidx.num_blocks)
        reach = offset_shards(layout, r, DEVICE)
        reaching = offsets_reaching(layout, r)
        out = torch.zeros(qs[r].shape, device=DEVICE)
        lse = torch.full((1, hq, layout.local_len), -torch.inf, device=DEVICE)
        out_t, lse_t = out.clone(), lse.clone()
        steps = []
        for srcs in groups:
            blocks = torch.cat([layout.block_ids(s) for s in srcs]).to(DEVICE)
            kv = [torch.cat([x[s] for s in srcs], dim=1) for x in (ks, vs)]
            kv_map = prepare_tile_map(blocks, kidx.num_blocks)
            width = 1 + max(reaching[s] for s in srcs)  # the longest list the layout allows, the diagonal included
            step = shard_index(index, owner, srcs, kidx, reach, kv_map, reaching)
            # The dk/dv pass walks, from each shard's key tiles, that shard's own offsets: a one-shard step's list,
            # nothing of it cut, counted per local key tile as that step counts it for the key tile's global block.
            assert step.key_slash.shape[0] == len(srcs) and step.key_slash.shape[-1] <= width
            counts = key_counts(step.key_slash, kv_map.blocks, None, kidx.num_blocks)
            tiles = layout.local_len // BS
            for g, s in enumerate(srcs):
                alone = shard_index(index, owner, range(s, s + 1), kidx, reach)
                kept = step.key_slash.shape[-1]
                assert torch.equal(step.key_slash[g], alone.slash[..., :kept])
                assert bool((alone.slash[..., kept:] == -1).all()), "a shard's list was cut"
                spans = kidx.num_blocks - 1 - kv_map.blocks[g * tiles : (g + 1) * tiles].long()
                assert torch.equal(counts[g], alone.scount[..., spans])
            pair = {"q_blocks": q_map, "kv_blocks": kv_map}
            vertical_slash_forward(qs[r], *kv, step, scale, out=out, lse=lse, **pair)
            torch_path.vertical_slash_forward(qs[r], *kv, index, scale, out=out_t, lse=lse_t, q_blocks=layout.block_ids(
                r).to(DEVICE), kv_blocks=blocks)  # fmt: skip
            _assert_close(f"running out q{r} after kv{list(srcs)}", out, out_t, tol)
            _assert_close(f"running lse q{r} after kv{list(srcs)}", lse, lse_t, tol)
            steps.append((srcs, kv, step, pair, blocks))
        _assert_close(f"out q{r}", out, layout.shard(ref_out, r), tol)
        _assert_close(f"lse q{r}", lse, layout.shard(ref_lse, r, dim=2), tol)
        dq = torch.zeros(qs[r].shape, dtype=torch.float64)
        for srcs, kv, step, pair, blocks in steps:
            args = (dos[r], qs[r], *kv, out, lse)
            got = vertical_slash_backward(*args, step, scale, **pair)
            want = torch_path.vertical_slash_backward(
                *args, index, scale, q_blocks=layout.block_ids(r).to(DEVICE), kv_blocks=blocks
            )
            for name, x, y in zip(("dq", "dk", "dv"), got, want):
                assert x.shape == y.shape
                _assert_close(f"{name} q{r} kv{list(srcs)}", x, y, tol)
            dq += got[0].cpu().double()
            for j, s in enumerate(srcs):
                part = slice(j * layout.local_len, (j + 1) * layout.local_len)
                dk[s] += got[1][:, part].cpu().double()
                dv[s] += got[2][:, part].cpu().double()
        _assert_close(f"dq q{r}", dq, layout.shard(ref_dq, r), tol)
    for s in range(world):
        _assert_close(f"dk kv{s}", dk[s], layout.shard(ref_dk, s), tol)
        _assert_close(f"dv kv{s}", dv[s], layout.shard(ref_dv, s), tol)


def test_kernel_form_counts_and_per_shard_lists_are_built_in_pieces_exactly(monkeypatch):
    """The offset counts are a histogram's running sum, and a gathered group's per-shard lists are sorted a few shards
    at a time (4M tokens on 1024 shards asked 16 GiB in one piece) and cut to the longest list: with pieces of one
    shard the kernel form is the one built whole, the cut lists are the whole ones without padding, and the counts
    are what they mean, the offsets ``0 <= o <= x`` per tile x."""
    from ds_mtraining.sparse.triton import kernel_index

    gen = torch.Generator().manual_seed(5)
    world, n, hq = 4, 1024, 3
    nb = n // BS
    layout = make_layout("striped", world, n, block_size=BS)
    index = _moved(random_index(2, hq, n, BS, num_cols=10, num_offsets=6, gen=gen), "cpu")  # host ops, any machine
    owner, reach = layout.block_owner_on("cpu"), offset_shards(layout, 1, "cpu")
    form = prepare_index(index, n)
    slash = index.slash
    want = ((slash[..., None] >= 0) & (slash[..., None] <= torch.arange(nb))).sum(2)  # [B, Hq, nb]
    assert form.scount.dtype == torch.int32 and torch.equal(form.scount.long(), want)
    wide = kernel_index.replace_slash(form, torch.cat([slash, torch.full_like(slash[..., :1], nb + 3)], -1))
    assert torch.equal(wide.scount, form.scount), "an offset past the last tile counts nowhere"
    whole = shard_index(index, owner, range(0, world), form, reach)
    reaching = offsets_reaching(layout, 1)
    width = 1 + max(reaching)
    cut = shard_index(index, owner, range(0, world), form, reach, reaching=reaching)
    monkeypatch.setattr(kernel_index, "CHUNK_ELEMENTS", 1)
    pieces = shard_index(index, owner, range(0, world), form, reach, reaching=reaching)
    assert whole.key_slash.shape[0] == world and cut.key_slash.shape[-1] == width < whole.key_slash.shape[-1]
    assert torch.equal(cut.key_slash, whole.key_slash[..., :width]) and bool((whole.key_slash[..., width:] == -1).all())
    for name in ("slash", "scount", "key_slash"):
        assert torch.equal(getattr(pieces, name), getattr(cut, name)), name
    assert torch.equal(prepare_index(index, n).scount, form.scount)

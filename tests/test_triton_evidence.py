"""Triton spread-evidence kernels against the PyTorch path (CPU: through the Triton interpreter).

The PyTorch path (``observation_logits`` -> ``row_statistics`` -> ``spread_evidence`` of the normalised
attention) is itself checked against loops in ``test_spread.py``; here the kernels must reproduce it on one
device and on a ring shard (blocks out of order, padding keys), where the shards' statistics and evidence,
reduced, must equal the whole sequence's. fp32 runs the dots in full precision, so errors are at fp32
rounding; a dropped key block or a wrong mask moves values by O(1e-3) or more.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from ds_mtraining.estimator.observe import index_mask, normalise, observation_logits, row_statistics
from ds_mtraining.estimator.spread.evidence import spread_evidence
from ds_mtraining.estimator.spread.geometry import tail_blocks
from ds_mtraining.estimator.spread.rows import spread_rows
from ds_mtraining.estimator.spread.spikes import SPIKES
from ds_mtraining.estimator.spread.tail import tail_residual
from ds_mtraining.estimator.triton import evidence as kernels
from ds_mtraining.estimator.triton import tail as tail_kernels
from ds_mtraining.sparse.index import VerticalSlashIndex

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(n: int, m: int, hq: int, hkv: int, d: int, dtype: torch.dtype, bs: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, n, hq, d, generator=gen) * 2.0  # peaked enough that the top entries stand out
    k = torch.randn(2, n, hkv, d, generator=gen)
    k[:, 3] *= 4.0  # one key many rows attend: a real column
    rows = spread_rows(n, m, bs)
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype), rows.to(DEVICE)


def _torch_path(q_obs, k, rows, keys, scale, seqlen, bs, exclusion):
    logits = observation_logits(q_obs, k, rows, keys, scale)
    row_max, row_sum = row_statistics(logits)
    evidence = spread_evidence(normalise(logits, row_max, row_sum), rows, keys, seqlen, bs, exclusion)
    return row_max, row_sum, evidence


@pytest.fixture(params=[None, 128], ids=["default-key-chunk", "key-chunks-of-two-blocks"])
def key_chunk(request, monkeypatch):
    """Keys per program of the statistics pass: the default (1024, one chunk at these lengths) and 128, so that
    whole chunks lie past a row tile's last row (skipped) beside the chunk that straddles it."""
    if request.param is not None:
        monkeypatch.setattr(kernels, "_KEY_CHUNK", request.param)
    return request.param


def _whole_blocks(k: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k padded with zero keys to whole blocks, and the keys' positions (those ``>= N`` are padding)."""
    pad = -k.shape[1] % bs
    k = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad))
    return k, torch.arange(k.shape[1], device=k.device)


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, what: str) -> None:
    err = (got.double() - want.double()).abs()
    bound = atol + rtol * want.double().abs()
    assert torch.all(err <= bound), f"{what}: max error {err.max().item():.3g} (worst excess {(err - bound).max():.3g})"


def _float64_evidence(q_obs, k, rows, scale, bs, exclusion):
    """Block mass, column sums and column top-2 from the float64 softmax, by their definitions."""
    batch, m, hq, _ = q_obs.shape
    n = k.shape[1]
    keys = torch.arange(n, device=k.device)
    kk = k.double().repeat_interleave(hq // k.shape[2], dim=2)
    logits = torch.einsum("bmhd,bnhd->bhmn", q_obs.double(), kk) * scale
    attn = logits.masked_fill(keys[None, :] > rows[:, None], float("-inf")).softmax(-1)  # [B, Hq, m, N]
    far = attn * (rows[:, None] - keys[None, :] >= exclusion)
    top = far.topk(2, dim=-2).values
    # Two entries equal in fp32 (rows saturating at probability ~1) count once in the kernels' rule (an exact tie
    # for the largest is one spike): no float64 value to compare there, so those keys are left out (NaN).
    tied = (top[..., 0, :] - top[..., 1, :]) <= 1e-6 * top[..., 0, :]
    top2 = torch.where(tied & (top[..., 1, :] > 0), float("nan"), top.sum(-2))
    return attn.view(batch, hq, m, n // bs, bs).sum(-1), far.sum(-2), top2


CASES = [
    # N, m, Hq, Hkv, D, dtype, bs, exclusion
    pytest.param(512, 24, 4, 2, 64, torch.float32, 64, 128, id="fp32-N512-m24-gqa2-bs64"),
    pytest.param(384, 70, 2, 1, 128, torch.float32, 128, 0, id="fp32-N384-m70-mqa-bs128-two-row-chunks"),
    pytest.param(448, 16, 4, 4, 64, torch.float16, 64, 64, id="fp16-N448-m16-mha-bs64"),
    pytest.param(384, 40, 6, 2, 64, torch.float32, 64, 64, id="fp32-N384-m40-group3-padded-heads"),
    # Row tiles that end long before the last keys: the statistics skip key tiles past their last row, the
    # evidence skips row chunks before its key block.
    pytest.param(1024, 130, 2, 1, 64, torch.float32, 64, 64, id="fp32-N1024-m130-causal-skips"),
]


@pytest.mark.parametrize("n, m, hq, hkv, d, dtype, bs, exclusion", CASES)
def test_kernels_match_torch_path(n, m, hq, hkv, d, dtype, bs, exclusion):
    q, k, rows = _inputs(n, m, hq, hkv, d, dtype, bs, seed=n + m)
    _compare(q, k, rows, bs, exclusion)


def test_causal_skips_keep_rows_on_the_edge(key_chunk):
    """Every row chunk of both kernels ends on the first key of a block (and of a statistics key tile): the skips
    must still count that one causal entry (they compare with ``<=``). With statistics key chunks of 128 keys
    (1024 by default), every other row chunk ends on a chunk's first key: that chunk is live, the later ones
    are skipped whole."""
    n, bs, hq, hkv = 512, 64, 4, 2
    q, k, _ = _inputs(n, 8, hq, hkv, 64, torch.float32, bs, seed=11)
    group = hq // hkv
    per_chunk = min(kernels._STATS_TILE, kernels._EVIDENCE_LAUNCH[bs][0]) // group  # rows per chunk (powers of 2)
    step = bs // per_chunk
    chunks = [torch.arange(bs * c + step, bs * (c + 1) + 1, step) for c in range(n // bs - 1)]  # ends at bs (c + 1)
    rows = torch.cat([*chunks, torch.tensor([n - 1])])
    assert rows.diff().gt(0).all() and rows[per_chunk - 1] == bs  # ascending; chunk 0 ends on block 1's first key
    _compare(q, k, rows.to(DEVICE), bs, 64)


def _compare(q, k, rows, bs, exclusion):
    """Statistics and evidence of the kernels vs the PyTorch path (and, in fp32, the float64 definitions)."""
    n, d, dtype = k.shape[1], k.shape[-1], k.dtype
    scale = d**-0.5
    keys = torch.arange(n, device=DEVICE)
    q_obs = q.index_select(1, rows)
    want_max, want_sum, want = _torch_path(q_obs, k, rows, keys, scale, n, bs, exclusion)
    row_max, row_sum = kernels.row_statistics(q_obs, k, rows, keys, scale)
    # fp16 dots round their products differently from the fp32 einsum of the PyTorch path.
    rtol = 1e-5 if dtype == torch.float32 else 2e-3
    _close(row_max, want_max, rtol, rtol, "row max")
    _close(row_sum, want_sum, rtol * 10, 0.0, "row sum")
    mass, col_sum, col_top, tail_sum = kernels.spread_evidence(
        q_obs, k, rows, keys, want_max, want_sum, scale, n, bs, exclusion
    )
    assert tail_sum.shape == (0, *col_sum.shape)  # no tail rows
    _close(mass, want.block_mass, rtol * 10, 1e-7, "block mass")
    _close(col_sum, want.column_sum, rtol * 10, 1e-7, "column sum")
    reference = _float64_evidence(q_obs, k, rows, scale, bs, exclusion)
    # Where a key's two largest far entries are (nearly) tied, the rule that an exact tie counts once turns a
    # rounding difference between the two paths into a jump (on a GPU, rows saturating at probability ~1 can
    # differ in the last bit, which moved a top-2 by 0.27 in one case): such keys are compared by neither check.
    kept = ~reference[2].isnan()
    assert kept.double().mean() > 0.99  # near-ties are rare: the comparison covers the keys
    _close(col_top[kept], want.column_top[kept], rtol * 10, 1e-7, "column top-2")
    assert col_top.abs().sum() > 0 and SPIKES == 2  # the far entries exist: the check compared real values
    if dtype == torch.float32:  # and the float64 definitions, at fp32 rounding
        for name, x, ref in zip(("block mass", "column sum", "column top-2"), (mass, col_sum, col_top), reference):
            kept = ~ref.isnan()
            _close(x[kept], ref[kept], 1e-4, 1e-7, f"{name} vs float64")


def test_shards_reduce_to_the_whole(key_chunk):
    """A striped-like shard: blocks out of order and a padding block; sums over shards equal the whole. With key
    chunks of two blocks, the statistics skip chunks whose keys all lie past a row tile, in any block order."""
    n, m, bs, d = 384, 72, 64, 64  # m > 64: some row tiles end before some shard blocks (skipped)
    q, k, rows = _inputs(n, m, 4, 2, d, torch.float32, bs, seed=7)
    scale, q_obs = d**-0.5, q.index_select(1, rows)
    whole_max, whole_sum, whole = _torch_path(q_obs, k, rows, torch.arange(n, device=DEVICE), scale, n, bs, 64)
    # Shard A holds blocks 5, 0, 3 and a padding block (positions >= n); shard B holds 1, 4, 2.
    shards = [[5, 0, 3, 6], [1, 4, 2]]
    maxes, sums, parts = [], [], []
    for blocks in shards:
        keys = torch.cat([torch.arange(b * bs, (b + 1) * bs) for b in blocks]).to(DEVICE)
        k_shard = torch.zeros(2, keys.numel(), 2, d, device=DEVICE)
        real = keys < n
        k_shard[:, real] = k[:, keys[real]]
        row_max, row_sum = kernels.row_statistics(q_obs, k_shard, rows, keys, scale)
        maxes.append(row_max)
        sums.append(row_sum)
        parts.append(
            kernels.spread_evidence(q_obs, k_shard, rows, keys, whole_max, whole_sum, scale, n, bs, 64),
        )
    # The reduction reduce_row_statistics performs over a process group, done by hand.
    global_max = torch.maximum(*maxes)
    total = sum(s * torch.exp((mx - global_max).double()) for s, mx in zip(sums, maxes))
    _close(global_max, whole_max, 1e-5, 1e-5, "reduced row max")
    _close(total, whole_sum, 1e-4, 0.0, "reduced row sum")
    for i, name in enumerate(("block mass", "column sum", "column top-2")):
        got = parts[0][i] + parts[1][i]
        want = (whole.block_mass, whole.column_sum, whole.column_top)[i]
        _close(got, want, 1e-4, 1e-7, name)


@pytest.mark.parametrize(
    "n, tail, bs, shards",
    [
        pytest.param(448, 40, 64, False, id="one-block"),
        pytest.param(460, 40, 64, False, id="two-blocks-partial-last"),
        pytest.param(512, 100, 64, False, id="three-blocks"),
        pytest.param(512, 300, 64, False, id="five-blocks-two-launches"),
        pytest.param(384, 70, 64, True, id="two-blocks-shards"),
    ],
)
def test_tail_sums_match_float64(n, tail, bs, shards):
    """The tail rows' attention summed per key and per query block: kernel vs PyTorch path vs the float64
    softmax, the spread rows' evidence unchanged beside them; on shards (blocks out of order, a padding block) the
    shards' sums add up to the whole."""
    m, d, hq, hkv = 24, 64, 4, 2
    q, k, rows = _inputs(n, m, hq, hkv, d, torch.float32, bs, seed=n + tail)
    observed = torch.cat([rows, torch.arange(n - tail, n, device=DEVICE)])
    scale, q_obs = d**-0.5, q.index_select(1, observed)
    k, keys = _whole_blocks(k, bs)
    logits = observation_logits(q_obs, k, observed, keys, scale)
    row_max, row_sum = row_statistics(logits)
    want = spread_evidence(normalise(logits, row_max, row_sum), observed, keys, n, bs, 64, tail)
    first, groups = tail_blocks(n, tail, bs)
    assert want.tail_sum.shape == (groups, 2, hq, n) and groups == (n - 1) // bs - (n - tail) // bs + 1
    # float64: the tail rows' softmax summed over the rows of each block.
    kk = k[:, :n].double().repeat_interleave(hq // hkv, dim=2)
    keys, tail_rows = keys[:n], observed[m:]
    exact = torch.einsum("bthd,bnhd->bhtn", q_obs[:, m:].double(), kk) * scale
    exact = exact.masked_fill(keys[None, :] > tail_rows[:, None], float("-inf")).softmax(-1)
    member = tail_rows // bs - first
    exact = torch.stack([exact[:, :, member == g].sum(2) for g in range(groups)])
    _close(want.tail_sum, exact, 1e-4, 1e-7, "PyTorch tail sums vs float64")
    if not shards:
        got = kernels.spread_evidence(q_obs, k, observed, torch.arange(k.shape[1], device=DEVICE), row_max, row_sum,
                                      scale, n, bs, 64, tail)  # fmt: skip
    else:
        nb = -(-n // bs)
        parts = []
        for blocks in ([4, 0, 2, nb], [1, 5, 3]):
            shard_keys = torch.cat([torch.arange(b * bs, (b + 1) * bs) for b in blocks]).to(DEVICE)
            k_shard = torch.zeros(2, shard_keys.numel(), hkv, d, device=DEVICE)
            real = shard_keys < n
            k_shard[:, real] = k[:, shard_keys[real]]
            parts.append(
                kernels.spread_evidence(q_obs, k_shard, observed, shard_keys, row_max, row_sum, scale, n, bs, 64, tail)
            )
        got = [a + b for a, b in zip(*parts, strict=True)]
    for name, x, ref in zip(
        ("block mass", "column sum", "column top-2", "tail sums"), got, dataclasses.astuple(want), strict=True
    ):
        _close(x, ref, 1e-4, 1e-7, f"kernel {name}")
    assert exact[-1].sum() > 0.5 * (tail_rows // bs == first + groups - 1).sum()  # real mass, not zeros


def test_bad_inputs_raise():
    q, k, rows = _inputs(256, 8, 4, 2, 64, torch.float32, 64, seed=0)
    keys = torch.arange(256, device=DEVICE)
    with pytest.raises(ValueError, match="share fp16, bf16 or fp32"):
        kernels.row_statistics(q[:, rows].half(), k, rows, keys, 1.0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        kernels.row_statistics(q[:, rows, :3], k, rows, keys, 1.0)
    with pytest.raises(ValueError, match="row_statistics: softmax_scale must be a positive finite number"):
        kernels.row_statistics(q[:, rows], k, rows, keys, 0.0)
    stats = torch.zeros(2, 4, rows.numel(), device=DEVICE), torch.ones(2, 4, rows.numel(), device=DEVICE)
    with pytest.raises(ValueError, match="whole blocks"):
        kernels.spread_evidence(q[:, rows], k[:, :200], rows, keys[:200], *stats, 1.0, 256, 64, 0)
    with pytest.raises(ValueError, match=r"keys \[n\] must match k"):
        kernels.spread_evidence(q[:, rows], k, rows, keys[:128], *stats, 1.0, 256, 64, 0)
    cand = torch.zeros(2, 4, 5, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"rows \[m\] must match q_obs"):
        kernels.candidate_attention(q[:, rows], k, rows[:-1], cand, cand, *stats, 1.0)
    with pytest.raises(ValueError, match=r"candidates and local must both be \[B, Hq, Kc\] = \[2, 4, Kc\]"):
        kernels.candidate_attention(q[:, rows], k, rows, cand, cand[..., :3], *stats, 1.0)


@pytest.mark.parametrize("path", ["torch", "kernel"])
@pytest.mark.parametrize("n, tail", [(448, 40), (460, 40)], ids=["one-block", "two-blocks"])
def test_tail_residual_matches_the_dense_mask(monkeypatch, n, tail, path):
    """``tail_residual`` from the per-block sums (the PyTorch split, and the Triton pass CUDA takes, in key chunks
    of 128 so rows span several programs and end inside one) against the tail rows' float64 attention and the
    index's dense mask (``index_mask``): the covered mass and, per key, the mass the index leaves out."""
    bs, d = 64, 64
    q, k, rows = _inputs(n, 8, 4, 2, d, torch.float32, bs, seed=3)
    tail_rows = torch.arange(n - tail, n, device=DEVICE)
    observed = torch.cat([rows, tail_rows])
    k, keys = _whole_blocks(k, bs)
    logits = observation_logits(q.index_select(1, observed), k, observed, keys, d**-0.5)
    row_max, row_sum = row_statistics(logits)
    attn = normalise(logits, row_max, row_sum)
    evidence = spread_evidence(attn, observed, keys, n, bs, 0, tail)
    gen = torch.Generator().manual_seed(3)
    vertical = torch.randint(0, n, (2, 4, 12), generator=gen)
    index = VerticalSlashIndex.build(vertical.to(DEVICE), torch.randint(0, n // bs, (2, 4, 2), generator=gen), bs)
    if path == "torch":
        on_cpu = VerticalSlashIndex(index.vertical.cpu(), index.slash.cpu(), bs)  # CUDA tensors take the kernel
        covered, per_key = tail_residual(on_cpu, evidence.tail_sum.cpu(), n, tail)
    else:
        monkeypatch.setattr(tail_kernels, "_KEYS", 128)
        first, _ = tail_blocks(n, tail, bs)
        inside, per_key = tail_kernels.tail_residual(
            evidence.tail_sum, index.offset_mask(n), index.column_mask(n), first, bs
        )
        covered = inside / tail
    covered, per_key = covered.to(DEVICE), per_key.to(DEVICE)
    attn = attn[:, :, rows.numel() :, :n].double()  # the tail rows; the padding keys' entries are 0
    inside = index_mask(index, tail_rows, keys[:n], n)
    want_covered = torch.where(inside, attn, 0.0).sum(-1).mean(-1)
    want_per_key = torch.where(inside, 0.0, attn).sum(-2)
    _close(covered, want_covered, 1e-5, 1e-7, "covered mass")
    _close(per_key, want_per_key, 1e-5, 1e-7, "outside mass per key")
    assert 0.05 < covered.mean() < 0.95, covered  # the mask covers some of the mass, not all of it


@pytest.mark.parametrize(
    "hq, hkv, d, dtype",
    [
        pytest.param(4, 2, 64, torch.float32, id="fp32-gqa2-d64"),
        pytest.param(6, 2, 128, torch.float32, id="fp32-group3-d128"),
        pytest.param(2, 2, 64, torch.float16, id="fp16-mha"),
    ],
)
def test_candidate_attention_matches_float64_softmax(hq, hkv, d, dtype):
    """The kernel's attention at candidate keys vs the float64 causal softmax: zero past the row (causal), on
    padding (``seqlen``) and where the shard does not hold the key (``local = -1``); the PyTorch path agrees."""
    n, m, bs = 448, 70, 64  # 70 rows: two row steps, the second partial
    q, k, rows = _inputs(n, m, hq, hkv, d, dtype, bs, seed=hq * d)
    scale, keys = d**-0.5, torch.arange(n, device=DEVICE)
    q_obs = q.index_select(1, rows)
    logits = observation_logits(q_obs, k, rows, keys, scale)
    row_max, row_sum = row_statistics(logits)
    gen = torch.Generator().manual_seed(hq)
    candidates = torch.sort(torch.randperm(n, generator=gen)[:100]).values.expand(2, hq, -1).clone()
    candidates[1, :, -3:] = n  # padding
    local = torch.where(candidates < n, candidates, -1)
    local[0, 0, ::7] = -1  # keys another shard holds
    candidates, local = candidates.to(DEVICE), local.to(DEVICE)
    got = kernels.candidate_attention(q_obs, k, rows, candidates, local, row_max, row_sum, scale)
    assert got.dtype == torch.float32 and got.shape == (2, hq, m, 100)

    kk = k.double().repeat_interleave(hq // hkv, dim=2)
    exact = torch.einsum("bmhd,bnhd->bhmn", q_obs.double(), kk) * scale
    exact = exact.masked_fill(keys[None, :] > rows[:, None], float("-inf")).softmax(-1)  # [B, Hq, m, N]
    want = exact.gather(-1, candidates.clamp(max=n - 1)[:, :, None, :].expand(-1, -1, m, -1))
    want = torch.where((local >= 0)[:, :, None, :], want, 0.0)
    rtol = 1e-4 if dtype == torch.float32 else 3e-3  # fp16 q/k: the dot rounds products the fp32 logits do not
    _close(got, want, rtol, 1e-9, "candidate attention vs float64")
    assert (got[..., (candidates[0, 0] > rows.max())] == 0).all() and (got[1, :, :, -3:] == 0).all()
    assert (got[0, 0, :, ::7] == 0).all() and got.sum() > 1.0  # the zeros are where they belong, the rest is real


def test_tail_residual_kernel_rejects_mismatched_shapes():
    sums = torch.zeros(2, 1, 3, 256, device=DEVICE)
    offsets, columns = torch.zeros(1, 3, 4, dtype=torch.bool), torch.zeros(1, 3, 256, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"must match tail_sum \[G, B, Hq, N\] = \(2, 1, 3, 256\)"):
        tail_kernels.tail_residual(sums, offsets.to(DEVICE), columns[..., :200].to(DEVICE), 2, 64)
    with pytest.raises(ValueError, match="query blocks 3 .. 4 run past the 4 blocks"):
        tail_kernels.tail_residual(sums, offsets.to(DEVICE), columns.to(DEVICE), 3, 64)

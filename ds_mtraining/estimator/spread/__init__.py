"""The ``"spread"`` strategy: observation rows over the whole sequence, a cost-aware greedy over both families.

The baseline looks at the last queries only, where recent columns and the local band cannot be told apart,
and fills each family to its own threshold; on real attention it lands at 2-3x the density of the best index
of the same family at equal recall. This strategy judges every candidate by *mass gained per entry paid*:

1. **Rows** (``rows.spread_rows``): ``rows`` single query rows, one per equal segment of the sequence,
   each placed at a different position *inside its block* (a row at a block end sees offsets 0-1 as richer
   than they are for the block's other rows), the last one at ``N - 1``; then the tail rows (step 5).
2. **Evidence** (``evidence``): the softmax statistics of all these rows from one sweep, then their exact causal
   softmax ``A`` reduced to per-row key-block mass ``S[i, kb]`` and per-column sums and spikes over the entries at
   least ``exclusion`` tokens behind their row (nearer ones belong to the local band, not to a column). On
   CUDA two Triton sweeps over the keys produce the same without materialising ``A`` (``estimator.triton.evidence``).
3. **Candidates** (``candidates``): the sinks plus the ``2 * max_columns`` columns with the best initial estimated
   mass per entry; their attention ``A[:, c]`` is recomputed from their keys (``[m, Kc]``), everything else about
   columns is forgotten, so the greedy works on small tensors.
4. **Greedy** (``greedy.spread_select``): from the forced entries (sinks, offsets ``< local_blocks``), in rounds
   of at most ``rounds(max_columns)[r]`` picks per head: score every unchosen offset and candidate column by

   - gain: residual mass of the sampled rows (mass not covered by the other family's chosen entries),
     scaled to all the rows the candidate covers — offsets: ``x (N - s·bs) / #rows that see offset s``;
     columns: drop the ``SPIKES`` largest rows' contributions (a diagonal crosses a key in one row, two
     diagonals can meet there in two; a column holds mass in every row), mean over the other
     rows, ``x (N - k)``;
   - cost: exact number of newly attended entries (a column's rows in tiles whose offset is chosen are
     free; an offset's tiles lose the entries of the chosen columns inside them); with packed documents
     both count inside the documents only, and a column's gain is the mean over its document's rows
     (``greedy._costs``);

   and take the best ratios in order while the sampled rows' covered mass (exact at the round's start, plus
   the picks' forecasts) is below ``recall``, within the caps (``max_columns`` columns and
   ``max_offsets`` offsets beyond the forced ones) and above ``min_ratio`` (estimated mean attention
   probability of the new entries). Picks of one round do not see each other; between rounds every score
   is recomputed exactly, and rounds grow geometrically (the first picks matter most).
5. **Tail** (``tail.tail_columns``): the last ``tail_rows`` queries (where a prompt's question sits, seen
   by one staggered row only) get up to ``tail_columns`` more columns for their exact attention mass
   outside the index, until they too keep ``recall`` (``tail.tail_residual``, from their attention summed
   per key and query block in the evidence sweep).

The recall report (``report.index_recall``) reuses the evidence's block mass and the columns' attention.
Everything is batched over batch and heads (no Python loop over heads or picks), sync-free, deterministic
(fp64 sums, stable sorts; atomics and scatter-adds only count integers) and device-agnostic. On a ring the same
steps run on the rank's key shard with the row statistics, the evidence and the candidates' attention reduced over
the ring, so every rank ends with the same index. The steps read their settings from ``settings.SpreadSettings``
only (``strategy``).

This package's ``__init__`` imports nothing: the Triton evidence kernel imports ``spread.geometry``, and the
strategy imports the kernels.
"""

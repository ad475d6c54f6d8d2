"""The spread estimator on packed real documents (CPU-sized): per layer, its in-document density and true recall.

SmolLM2-135M reads ``--rows`` rows of ``--length`` tokens packed from Python standard-library modules of 300-1500
tokens (the ``python-stdlib`` corpus source, shuffled with ``--seed``), its positions restarting at every document
(``"document_masking": true``). Each chosen layer's post-RoPE q/k are captured from one dense forward, then
``estimate_index`` runs on them with the documents, under the settings of ``--ds-config``. Against the exact
in-document attention of every head it reports, per layer and over the layers:

- **density**: attended fraction of the causal in-document entries;
- **true recall**: the attention mass inside the index, over all rows;
- **heads < 0.9**: heads keeping less than 0.9 of their mass.

    python -m benchmarks.packed_estimate --layers 1 2 7 12 20 25 --out FILE

Run it from two checkouts to compare two versions of the estimator on the same inputs (the inputs depend only on
the model, the standard library's files and the seed).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

from benchmarks import harness
from ds_mtraining.config import MTrainingConfig, SparseAttentionConfig
from ds_mtraining.data.corpus import default_corpus
from ds_mtraining.data.packing import pack_documents, position_ids
from ds_mtraining.data.tokenize import separator_id, tokenize_documents
from ds_mtraining.estimator import estimate_index
from ds_mtraining.integration.transformers import NAME, MTrainingAttention
from ds_mtraining.models import load_pretrained
from ds_mtraining.sparse import AttentionPattern, Documents

REPO = Path(__file__).resolve().parent.parent


def packed_rows(tokenizer, length: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and document ids ``[rows, length]``: modules of 300-1500 tokens, shuffled, packed in order."""
    documents = [d for d in tokenize_documents(tokenizer, default_corpus(["python-stdlib"])) if 300 <= len(d) <= 1500]
    random.Random(seed).shuffle(documents)
    packed = pack_documents(documents, seqlen=length, separator=separator_id(tokenizer))
    return packed.tokens[:rows], packed.documents[:rows]


def capture(model, tokens: torch.Tensor, documents: torch.Tensor, layers: list[int]) -> dict[int, tuple]:
    """Each layer's post-RoPE ``(q, k, scale)`` from one dense forward over the packed rows."""
    captured = {}

    def probe(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
        if layer in layers:
            captured[layer] = (q.float().clone(), k.float().clone(), scale)

    attention = MTrainingAttention(SparseAttentionConfig(pattern="dense"), probe=probe, packed=True)
    with torch.no_grad():
        model(tokens, position_ids=position_ids(documents), mtraining=attention, use_cache=False)
    return captured


def measure(q: torch.Tensor, k: torch.Tensor, scale: float, documents: Documents, config: SparseAttentionConfig):
    """Per head ``[B, Hq]``: in-document density (``AttentionPattern.density``) and true recall of the
    estimated index."""
    n, heads, group = q.shape[1], q.shape[2], q.shape[2] // k.shape[2]
    rows = AttentionPattern(n, documents=documents)
    pattern = rows.with_index(estimate_index(q, k, config, softmax_scale=scale, pattern=rows))
    allowed = documents.mask()  # [B, N, N]: causal, inside the document
    attended = pattern.dense_mask() & allowed[:, None]
    recall = torch.empty(q.shape[0], heads, dtype=torch.float64)
    for h in range(heads):  # one head's [B, N, N] at a time: fp64 at 4K is 128 MB a row
        logits = torch.einsum("bid,bjd->bij", q[:, :, h].double(), k[:, :, h // group].double()) * scale
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
        recall[:, h] = (probs * attended[:, h]).sum(-1).mean(-1)
    return pattern.density(), recall


def table_row(label: str, density: torch.Tensor, recall: torch.Tensor) -> str:
    """One line of the report over the heads in ``density`` / ``recall``."""
    return (
        f"| {label} | {density.mean():.4f} | {recall.mean():.4f} | {recall.min():.3f} | "
        f"{int((recall < 0.9).sum())} of {recall.numel()} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 7, 12, 20, 25])
    parser.add_argument("--ds-config", type=Path, default=REPO / "ds_configs" / "zero2_offload.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    config = MTrainingConfig.from_deepspeed_config(args.ds_config).sparse_attention
    model, tokenizer = load_pretrained("smollm2-135m", attn_implementation=NAME)
    tokens, document_ids = packed_rows(tokenizer, args.length, args.rows, args.seed)
    documents = Documents.from_document_ids(document_ids)
    lengths = [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in document_ids]
    report = harness.Report(args.out)
    report.add(
        *harness.header("The spread estimator on packed documents", __spec__.name, argv, device="cpu"),
        "",
        f"documents per row (tokens): {lengths}",
        "",
        "| layer | density | true recall | lowest head | heads < 0.9 |",
        "|---|---|---|---|---|",
    )
    densities, recalls = [], []
    for layer, (q, k, scale) in sorted(capture(model, tokens, document_ids, args.layers).items()):
        density, recall = measure(q, k, scale, documents, config.for_layer(layer))
        densities.append(density)
        recalls.append(recall)
        report.add(table_row(str(layer), density, recall))
    report.add(table_row("**all**", torch.stack(densities), torch.stack(recalls)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

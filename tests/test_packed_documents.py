"""Packed documents end to end (issue 26): the batch's positions and labels, the model's attention inside each
document (dense and sparse layers, float64 against each document run alone), the config key and the training job."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_integration_transformers import sdpa_and_ours
from test_train import REPO, metrics, train
from train_job import launched_job, refusal, save_model_with_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from ds_mtraining.config import BaselineEstimator, ConfigError, MTrainingConfig, SparseAttentionConfig
from ds_mtraining.data.packing import pack_documents, save_packed
from ds_mtraining.integration.batch import IGNORE, make_batch
from ds_mtraining.integration.transformers import (
    MTrainingAttention,
    documents_from_kwargs,
    mtraining_attention_forward,
)
from ds_mtraining.parallel.mesh import MeshCoordinates, MeshShape
from ds_mtraining.sparse import AttentionPattern, Documents

TINY = {
    "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 1024, "use_cache": False,
}  # fmt: skip
MODELS = [
    pytest.param(Qwen2ForCausalLM, Qwen2Config, id="qwen2"),
    pytest.param(LlamaForCausalLM, LlamaConfig, id="llama"),
]
DENSE = SparseAttentionConfig(pattern="dense")
# Every diagonal forced (a minimum past the length): the index holds every causal entry, so the sparse path is exact.
# Recall targets alone would not do: the estimator's rows see only their own document, so it leaves out the entries
# of the documents no row observes.
EVERYTHING = SparseAttentionConfig(
    estimator=BaselineEstimator(
        column_recall=1.0, diagonal_recall=1.0, max_columns=4096, min_diagonals=4096, max_diagonals=4096
    )
)
LENGTHS = [1, 37, 64, 65, 1, 32]
"""Documents of one token, inside a block, exactly a block, across a block boundary (block size 64)."""


def _positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None]


# ------------------------------------------------------------------------------------------------------------
# The batch
# ------------------------------------------------------------------------------------------------------------


def test_packed_row_positions_and_labels():
    """Separator 0 after every document; the row starts inside a document (id 7) and ends inside one."""
    tokens = torch.tensor([[11, 12, 0, 21, 0, 0, 31, 32, 33, 0, 41, 42]])
    documents = torch.tensor([[7, 7, 7, 8, 8, 9, 10, 10, 10, 10, 11, 11]])
    batch = make_batch(tokens, mesh=None, layout=None, pad_id=0, documents=documents)
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 0, 1]]
    # A document's last token (its separator) predicts nothing; the others predict the next token, the separator
    # included. The empty document (a lone separator, id 9) has no target at all.
    i = IGNORE
    assert batch.labels.tolist() == [[12, 0, i, 0, i, i, 32, 33, 0, i, 42, i]]
    assert batch.label_tokens == 7
    assert torch.equal(batch.input_ids, tokens)
    # Attention reads the documents back from the positions.
    starts = Documents.from_position_ids(batch.position_ids).starts
    assert torch.equal(starts, Documents.from_document_ids(documents).starts)


def test_callers_labels_are_shifted_and_masked_as_the_tokens():
    """Labels in transformers' convention (unshifted, -100 on a prompt): position t's target is label t + 1, the
    document boundaries still mask theirs, and only the targets left count."""
    i = IGNORE
    tokens = torch.tensor([[11, 12, 13, 14, 21, 22, 23]])
    labels = torch.tensor([[i, i, 13, 14, i, 22, 23]])  # each document's first tokens are its prompt
    documents = torch.tensor([[1, 1, 1, 1, 2, 2, 2]])
    batch = make_batch(tokens, mesh=None, layout=None, pad_id=0, documents=documents, labels=labels)
    assert batch.labels.tolist() == [[i, 13, 14, i, 22, 23, i]]
    assert batch.label_tokens == 4 and torch.equal(batch.input_ids, tokens)
    plain = make_batch(tokens, mesh=None, layout=None, pad_id=0, labels=tokens)
    assert torch.equal(plain.labels, make_batch(tokens, mesh=None, layout=None, pad_id=0).labels)
    with pytest.raises(ValueError, match="must match tokens"):
        make_batch(tokens, mesh=None, layout=None, pad_id=0, labels=labels[:, :3])

def test_packed_rows_from_the_packer():
    docs = [[5], [6, 7, 8], [], [9, 10]]
    packed = pack_documents(docs * 3, seqlen=10, separator=0)
    batch = make_batch(packed.tokens, mesh=None, layout=None, pad_id=0, documents=packed.documents)
    plain = make_batch(packed.tokens, mesh=None, layout=None, pad_id=0)
    assert batch.position_ids[0].tolist() == [0, 1, 0, 1, 2, 3, 0, 0, 1, 2]
    crossing = packed.documents[:, 1:] != packed.documents[:, :-1]
    assert (batch.labels[:, :-1][crossing] == IGNORE).all()
    assert torch.equal(batch.labels[:, :-1][~crossing], plain.labels[:, :-1][~crossing])
    assert batch.label_tokens == plain.label_tokens - int(crossing.sum())
    with pytest.raises(ValueError, match="must match tokens"):
        make_batch(packed.tokens, mesh=None, layout=None, pad_id=0, documents=packed.documents[:, :5])


def test_sequence_parallel_shards_keep_the_global_document_positions():
    """Positions and labels are computed on the whole sequence, then cut with the layout (shift before shard)."""
    shape = MeshShape.build(world=4, ulysses=2, ring=2, q_heads=4, kv_heads=2)
    layout = shape.layout(200, kind="striped", block_size=64, stripe=None)

    tokens = torch.arange(200)[None] + 10
    documents = torch.repeat_interleave(torch.arange(4), torch.tensor([1, 70, 64, 65]))[None]
    whole = make_batch(tokens, mesh=None, layout=None, pad_id=0, documents=documents)
    pad = layout.padded_len - 200
    positions = torch.cat([whole.position_ids, whole.position_ids[:, -1:] + 1 + torch.arange(pad)], dim=1)
    labels = torch.cat([whole.labels, torch.full((1, pad), IGNORE)], dim=1)
    for rank in range(4):
        _, ring_rank, ulysses_rank = shape.coords(rank)
        mesh = MeshCoordinates(shape, ring_rank, ulysses_rank)  # what Mesh.shard cuts with, without process groups
        part = make_batch(tokens, mesh=mesh, layout=layout, pad_id=0, documents=documents)
        assert torch.equal(part.position_ids, mesh.shard(positions, layout))
        assert torch.equal(part.labels, mesh.shard(labels, layout))
        assert part.label_tokens == whole.label_tokens


# ------------------------------------------------------------------------------------------------------------
# The model: a packed row is its documents run alone
# ------------------------------------------------------------------------------------------------------------


def _loss(logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A loss that is a sum over tokens, so the packed row's is the sum of its documents'."""
    return (logits.square() * weights).sum()


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("model_cls,config_cls", MODELS)
@pytest.mark.parametrize("sparse", [pytest.param(DENSE, id="dense"), pytest.param(EVERYTHING, id="sparse")])
def test_packed_row_equals_its_documents_alone(model_cls, config_cls, sparse):
    reference, ours = sdpa_and_ours(model_cls, config_cls(**TINY))
    n = sum(LENGTHS)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (1, n), generator=gen)
    weights = torch.rand(1, n, TINY["vocab_size"], generator=gen, dtype=torch.float64)
    attention = MTrainingAttention(sparse, packed=True)
    packed = ours(ids, position_ids=_positions(LENGTHS), mtraining=attention).logits
    _loss(packed, weights).backward()
    assert sorted(attention.stats) == [0, 1]
    if sparse is EVERYTHING:  # the layers ran the sparse path, over an index of every causal entry
        assert all(float(s.density) == pytest.approx(1.0) for s in attention.stats.values())
    expected = {name: torch.zeros_like(p) for name, p in reference.named_parameters()}
    at = 0
    for length in LENGTHS:  # each document alone, through transformers' own attention
        reference.zero_grad()
        alone = reference(ids[:, at : at + length]).logits
        _loss(alone, weights[:, at : at + length]).backward()
        torch.testing.assert_close(packed[:, at : at + length].detach(), alone.detach(), atol=1e-12, rtol=1e-12)
        for name, grad in _grads(reference).items():
            expected[name] += grad
        at += length
    for name, grad in _grads(ours).items():
        torch.testing.assert_close(
            grad, expected[name], atol=1e-10, rtol=1e-10, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_flattened_batch_kwargs_give_the_documents():
    """``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``'s ``cu_seq_lens_q`` / ``cu_seq_lens_k`` mark the
    documents without ``packed``; without either the row is one sequence."""
    reference, ours = sdpa_and_ours(Qwen2ForCausalLM, Qwen2Config(**TINY))
    ids = torch.randint(0, TINY["vocab_size"], (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(2))
    positions = _positions(LENGTHS)
    cu = torch.tensor([0, *LENGTHS]).cumsum(0)
    flat = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(LENGTHS), "max_length_k": max(LENGTHS)}
    with torch.no_grad():
        expected = reference(ids, position_ids=positions).logits  # transformers finds the packing itself
        by_cu = ours(ids, position_ids=positions, mtraining=MTrainingAttention(EVERYTHING), **flat).logits
        unmasked = ours(ids, position_ids=positions, mtraining=MTrainingAttention(EVERYTHING)).logits
        torch.testing.assert_close(by_cu, expected, atol=1e-12, rtol=1e-12)
        assert (unmasked - expected).abs().max() > 1e-3
        other = cu.clone()
        other[1] += 1
        with pytest.raises(ValueError, match="differs from cu_seq_lens_q"):
            ours(
                ids, position_ids=positions, mtraining=MTrainingAttention(DENSE), cu_seq_lens_q=cu, cu_seq_lens_k=other
            )


def test_documents_from_kwargs_are_built_fresh_every_call():
    """``documents_from_kwargs``: ``cu_seq_lens_q`` (first), else the position ids (which the model passes only for
    a ``packed`` handle), else one sequence a row; every call builds its documents from the tensors' current values,
    so a tensor changed in place is read again. ``cu_seq_lens_k`` must equal ``cu_seq_lens_q``."""
    positions = _positions([30, 34])
    two = torch.cat([torch.zeros(30, dtype=torch.long), torch.full((34,), 30)])
    documents = documents_from_kwargs(positions, None, None, 2, 64)
    assert torch.equal(documents.starts, two.expand(2, -1))  # [1, N] position ids serve every row
    positions[0, 30:] += 30  # changed in place: one document now, read again
    assert torch.equal(documents_from_kwargs(positions, None, None, 2, 64).starts, torch.zeros(2, 64, dtype=torch.long))
    assert torch.equal(documents.starts, two.expand(2, -1))  # the earlier call's documents are its own
    assert documents_from_kwargs(None, None, None, 1, 64) is None
    cu = torch.tensor([0, 30, 64])
    for k in (None, cu, cu.clone()):  # the lengths win over the (now one-document) position ids
        assert torch.equal(documents_from_kwargs(positions, cu, k, 1, 64).starts, two[None])
    cu[1] = 10  # changed in place: read again
    ten = torch.cat([torch.zeros(10, dtype=torch.long), torch.full((54,), 10)])
    assert torch.equal(documents_from_kwargs(None, cu, cu, 1, 64).starts, ten[None])
    other = cu.clone()
    other[1] += 1
    with pytest.raises(ValueError, match=r"cu_seq_lens_k \[0, 11, 64\] differs from cu_seq_lens_q \[0, 10, 64\]"):
        documents_from_kwargs(None, cu, other, 1, 64)


def test_each_layer_builds_its_documents_from_its_kwargs(monkeypatch):
    """In the model every layer builds its documents from the position ids it is handed (no cache across layers or
    forwards): a tensor changed in place between forwards is read again, and a handle that is not ``packed`` builds
    none from the position ids."""
    _, ours = sdpa_and_ours(Qwen2ForCausalLM, Qwen2Config(**TINY))
    built = []
    original = Documents.from_position_ids.__func__
    monkeypatch.setattr(Documents, "from_position_ids", classmethod(lambda cls, p: built.append(1) or original(cls, p)))
    ids = torch.randint(0, TINY["vocab_size"], (1, 64))
    positions = _positions([30, 34])
    attention = MTrainingAttention(DENSE, packed=True)
    first = ours(ids, position_ids=positions, mtraining=attention).logits
    assert len(built) == 2  # two layers, a build each
    positions[0, 30:] += 30  # changed in place: one document now, read again
    second = ours(ids, position_ids=positions, mtraining=attention).logits
    assert len(built) == 4 and not torch.allclose(first[:, 30:], second[:, 30:])
    ours(ids, position_ids=positions, mtraining=MTrainingAttention(DENSE))
    assert len(built) == 4  # not packed: the position ids only rotate


def test_documents_under_sequence_parallelism_come_with_the_batch():
    """A shard's position ids do not mark documents: under sequence parallelism the whole rows' documents must come
    as ``mtraining_documents`` (the batch's), and decoding over a KV cache takes none."""

    class TwoRanks:
        sp_size = 2

    hf_q = torch.zeros(1, 2, 8, 4, dtype=torch.float64)  # [B, H, N, D], as transformers hands it over
    layer = SimpleNamespace(layer_idx=0)
    sharded = MTrainingAttention(DENSE, mesh=TwoRanks(), packed=True)
    with pytest.raises(ValueError, match="pass the whole rows' documents as mtraining_documents"):
        mtraining_attention_forward(layer, hf_q, hf_q, hf_q, None, mtraining=sharded, position_ids=_positions([3, 5]))
    q = hf_q.transpose(1, 2)
    with pytest.raises(ValueError, match="decoding over a KV cache"):
        MTrainingAttention(DENSE).attend(
            0, q[:, :1], q, q, 0.5, AttentionPattern(1, documents=Documents.from_position_ids(_positions([1])))
        )


# ------------------------------------------------------------------------------------------------------------
# Config and the training job
# ------------------------------------------------------------------------------------------------------------


def _section(section: dict) -> MTrainingConfig:
    return MTrainingConfig.from_deepspeed_config({"mtraining": section})


def test_config_key():
    assert MTrainingConfig().data.document_masking is False
    assert _section({"data": {"document_masking": True}}).data.document_masking is True
    with pytest.raises(ConfigError, match=r"mtraining\.data\.masking: unknown key; allowed keys: document_masking"):
        _section({"data": {"masking": True}})
    with pytest.raises(ConfigError, match=r"mtraining\.data\.document_masking = 'yes': Input should be a valid bool"):
        _section({"data": {"document_masking": "yes"}})
    sp = {"sequence_parallel_size": 2, "ring_degree": 2}  # the ring and Ulysses take documents
    assert _section({"data": {"document_masking": True}, "parallel": sp}).parallel.sequence_parallel_size == 2


def _masking_config(tmp_path, masking: bool = True, **parallel) -> str:
    config = json.loads((REPO / "ds_configs" / "zero2_offload.json").read_text())
    config["mtraining"]["data"] = {"document_masking": masking}
    config["mtraining"]["parallel"] |= parallel
    config["mtraining"]["sparse_attention"]["estimator"] |= {"rows": 32, "max_columns": 256, "max_offsets": 4}
    config["optimizer"]["params"] |= {"lr": 0.0, "weight_decay": 0.0}  # the weights stay the initial ones
    del config["scheduler"]
    path = tmp_path / f"config-{masking}.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    """A config-only tiny Qwen2 folder with a word-level tokenizer (separator ``w1``), and one packed row of 512
    tokens holding documents of 0 to 150 tokens (so every step and the held-out loss read that row)."""
    root = tmp_path_factory.mktemp("packed")
    # Head dim 64, which the job's sparse attention serves (the equivalence tests' 16 is fine off the job).
    config = Qwen2Config(**TINY | {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1})
    save_model_with_tokenizer(root / "model", config)
    gen = torch.Generator().manual_seed(0)
    docs = [
        torch.randint(2, TINY["vocab_size"], (int(n),), generator=gen).tolist()
        for n in torch.randint(0, 150, (8,), generator=gen)
    ]
    assert 512 <= sum(map(len, docs)) + len(docs) < 1024
    save_packed(pack_documents(docs, seqlen=512, separator=1), root / "data")
    return root / "model", root / "data"


def test_train_with_document_masking_alone_and_on_a_ring(model_and_data, tmp_path):
    """The main job with documents masked, in one process and on a ring of 2 (lr 0: every step the same row and
    weights): the held-out loss of the row trained on is its training loss; the ring's loss is the one process's; and
    without the masking the loss differs, so both really mask the documents."""
    import subprocess

    model, data = model_and_data
    out = tmp_path / "out"
    result = train(
        "--model", str(model), "--data", str(data), "--heldout", str(data), "--heldout-rows", "1",
        "--deepspeed", _masking_config(tmp_path), "--steps", "2", "--no-save", "--output-dir", str(out),
    )  # fmt: skip
    assert "documents masked" in result.stdout
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["density"][0] == 1.0 and records[0]["density"][1] < 1.0  # a dense and a sparse layer ran
    # lr 0: the held-out loss of the row trained on is its training loss, documents masked in both.
    masked = records[0]["loss"]
    assert masked > 0 and abs(records[-1]["heldout_loss"] - records[-1]["loss"]) <= 1e-5 * masked
    # The same row and weights without the masking: only the documents make the loss differ.
    plain = train(
        "--model", str(model), "--data", str(data), "--deepspeed", _masking_config(tmp_path, masking=False),
        "--steps", "1", "--no-save", "--output-dir", str(tmp_path / "plain"),
    )  # fmt: skip
    assert "documents not masked" in plain.stdout
    assert abs(metrics(tmp_path / "plain")[0]["loss"] - masked) > 1e-4

    ring = tmp_path / "ring"
    ring.mkdir()
    config = _masking_config(ring, sequence_parallel_size=2, ring_degree=2)
    flags = ["--model", str(model), "--data", str(data), "--steps", "1", "--no-save", "--seqlen", "512"]
    command, env = launched_job(ring, 2, *flags, "--deepspeed", config, "--output-dir", str(ring / "out"))
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    (record,) = metrics(ring / "out")
    assert abs(record["loss"] - masked) <= 1e-5 * masked, (record["loss"], masked)
    # DeepSpeed's CPU all-reduce workspaces (67 MB a rank in /dev/shm) are gone with the job.
    port = command[command.index("--master_port") + 1]
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def test_train_refuses_masking_it_cannot_do(tmp_path, capsys):
    from ds_mtraining.training.cli import main

    def fails(argv: list[str], needle: str) -> None:
        refusal(main([*argv, "--output-dir", str(tmp_path / "out")]), capsys.readouterr(), needle)
        assert not (tmp_path / "out").exists()

    fails(["--deepspeed", _masking_config(tmp_path), "--seqlen", "512"], "tiny-qwen2 has no tokenizer")

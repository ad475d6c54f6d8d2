"""NIAH prompt building and scoring, RULER generation offline (a byte-level tokenizer stands in for the model's)."""

import sys

import pytest

from ds_mtraining.eval.niah import make_niah_prompt, string_match_all
from ds_mtraining.eval.ruler import generate_task, score_task, split_sentences


@pytest.fixture(scope="module")
def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


HAYSTACK = " ".join(f"Sentence number {i} talks about the weather in town {i % 7}." for i in range(300))


def test_niah_scoring_pass_and_fail(byte_tokenizer):
    ids, answer = make_niah_prompt(byte_tokenizer, HAYSTACK, 2000, 0.5, seed=3)
    prompt = byte_tokenizer.decode(ids[0])
    assert ids.shape[1] <= 2000 and answer in prompt and prompt.rstrip().endswith("is")
    assert string_match_all(f" {answer}.", [answer]) == 100.0  # built to pass
    assert string_match_all(" 1234567.", [answer if answer != "1234567" else "7654321"]) == 0.0  # built to fail
    assert string_match_all("7 and 8", ["7", "8", "9"]) == pytest.approx(200 / 3)


@pytest.mark.parametrize("depth", [0.0, 1.0], ids=["start", "end"])
def test_niah_needle_depth(byte_tokenizer, depth):
    ids, answer = make_niah_prompt(byte_tokenizer, HAYSTACK, 3000, depth, seed=1)
    prompt = byte_tokenizer.decode(ids[0])
    at = prompt.index(answer) / len(prompt)
    assert at < 0.2 if depth == 0.0 else at > 0.8


def test_offline_sentence_splitter():
    text = 'Dr. Smith went to Washington. He met J. R. Jones at 3 p.m. today! "Really?" She asked. The U.S. flag.'
    assert split_sentences(text) == [
        "Dr. Smith went to Washington.",
        "He met J. R. Jones at 3 p.m. today!",
        '"Really?"',
        "She asked.",
        "The U.S. flag.",
    ]


# RULER builds every adjective-noun pair of wonderwords' lists on each run (~10 s); small lists keep tests fast.
WORDS = {
    "nounlist.txt": ["apple", "river", "stone", "cloud", "lantern"],
    "adjectivelist.txt": ["red", "quiet", "bold", "amber"],
    "verblist.txt": ["run", "jump"],
}


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_multikey_2", "niah_multivalue"])
def test_ruler_generation_runs_offline(byte_tokenizer, task):
    path, argv = list(sys.path), list(sys.argv)
    samples = generate_task(task, byte_tokenizer, 6000, 2, seed=5, words=WORDS)
    assert not {"nltk", "tokenizer", "wonderwords"} & set(sys.modules)  # stubs removed again
    assert sys.path == path and sys.argv == argv
    assert len(samples) == 2
    for s in samples:
        assert s.outputs and all(out in s.input for out in s.outputs)
        assert 3000 < len(byte_tokenizer(s.input, add_special_tokens=False).input_ids) + s.tokens_to_generate <= 6000
    again = generate_task(task, byte_tokenizer, 6000, 2, seed=5, words=WORDS)
    assert [s.input for s in again] == [s.input for s in samples]  # deterministic
    assert score_task(task, [" ".join(s.outputs) for s in samples], [s.outputs for s in samples]) == 100.0
    assert score_task(task, ["no idea"] * 2, [s.outputs for s in samples]) == 0.0

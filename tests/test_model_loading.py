"""``--model`` as a Hugging Face folder or a config-only folder (``ds_mtraining.integration.model_loading``), the start-up
check of what the sparse attention serves, and the export back to a Hugging Face folder (``.export``)."""

from __future__ import annotations

import json
import math
import runpy
import subprocess
import sys

import pytest
import torch
from test_train import REPO, SEQLEN, train, write_config
from train_job import refusal
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    BertConfig,
    FalconConfig,
    Gemma2Config,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from ds_mtraining.config import SparseAttentionConfig
from ds_mtraining.integration.export import export_hf_folder
from ds_mtraining.integration.model_loading import (
    ModelError,
    UnsupportedModelError,
    check_supported,
    resolve_model,
    tokenizer_folder,
)
from ds_mtraining.integration.transformers import MTrainingAttention
from ds_mtraining.models import RopeScaling

VOCAB = 96
# Head dim 64 (128 / 2 heads), one KV head.
TINY = {
    "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 1024,
}  # fmt: skip
FAMILIES = {
    "llama": LlamaConfig(**TINY),
    "qwen2": Qwen2Config(**TINY),  # q/k/v biases: fine
    "qwen3": Qwen3Config(**TINY, head_dim=64),  # Qwen3's default head dim is 128
    "mistral": MistralConfig(**TINY, sliding_window=None),  # Mistral v0.2+; v0.1's window is rejected below
}
DENSE = SparseAttentionConfig(pattern="dense")


def _tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w1")


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``family -> (folder, state dict)``: each tiny model saved (fp32 safetensors) with its own seed, the llama
    folder with a tokenizer; plus ``"config-only"``: a Qwen3 config.json alone (bf16, vocabulary 80)."""
    root = tmp_path_factory.mktemp("models")
    saved = {}
    for seed, (family, config) in enumerate(FAMILIES.items(), start=1000):
        torch.manual_seed(seed)  # not the seed the tests build with: a random init would not match
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(root / family)
        saved[family] = (root / family, model.state_dict())
    _tokenizer().save_pretrained(root / "llama")
    Qwen3Config(**(TINY | {"vocab_size": 80}), head_dim=64, dtype="bfloat16").save_pretrained(root / "config-only")
    saved["config-only"] = (root / "config-only", None)
    return saved


@pytest.mark.parametrize("family", FAMILIES)
def test_folder_loads_its_weights_under_our_attention(folders, family):
    folder, weights = folders[family]
    spec = resolve_model(str(folder))
    assert (spec.name, spec.pretrained, spec.weights_dir, spec.config.use_cache) == (family, True, folder, False)
    assert spec.tokenizer_dir == (folder if family == "llama" else None)
    model = spec.build(seed=0)
    assert model.config._attn_implementation == "mtraining"
    assert _equal(model.state_dict(), weights)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # Dense pattern through our attention function == transformers' SDPA on the same weights.
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.randint(0, VOCAB, (1, 128), generator=torch.Generator().manual_seed(0))
    attention = MTrainingAttention(DENSE)
    with torch.no_grad():
        logits = model(ids, mtraining=attention).logits
        torch.testing.assert_close(logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    assert sorted(attention.stats) == [0, 1]  # every layer ran through it


def test_config_only_folder_is_a_seeded_random_init(folders):
    folder, _ = folders["config-only"]
    spec = resolve_model(str(folder))
    assert (spec.name, spec.pretrained, spec.weights_dir, spec.tokenizer_dir) == ("config-only", False, None, None)
    first, again, other = (spec.build(seed).state_dict() for seed in (0, 0, 1))
    assert _equal(first, again)
    assert not any(torch.equal(first[k], other[k]) for k in first if k.endswith("proj.weight"))
    assert first["model.embed_tokens.weight"].shape == (80, 128)  # the config's vocabulary
    assert first["model.embed_tokens.weight"].dtype == torch.float32  # fp32 master weights, not the config's bf16
    model = spec.build(0)
    assert model.config._attn_implementation == "mtraining"
    model(torch.randint(0, 80, (1, 64)), mtraining=MTrainingAttention(DENSE))


def test_config_file_path_is_a_random_init_with_the_folders_tokenizer(folders):
    folder, weights = folders["llama"]
    spec = resolve_model(str(folder / "config.json"))
    assert (spec.name, spec.pretrained, spec.tokenizer_dir) == ("llama", False, folder)
    built = spec.build(seed=0).state_dict()
    assert built.keys() == weights.keys() and not torch.equal(built["lm_head.weight"], weights["lm_head.weight"])


def test_tokenizer_folder_is_the_one_train_reads_or_a_one_line_refusal(folders, tmp_path):
    llama, _ = folders["llama"]
    assert tokenizer_folder(str(llama)) == llama == tokenizer_folder(str(llama / "config.json"))
    assert tokenizer_folder(str(llama)) == resolve_model(str(llama)).tokenizer_dir
    config_only, _ = folders["config-only"]
    # Without the check transformers builds a tokenizer from the config alone, with no vocabulary, silently.
    with pytest.raises(ModelError, match=r"config-only has no tokenizer \(none of tokenizer.json"):
        tokenizer_folder(str(config_only))
    with pytest.raises(ModelError, match="tiny-qwen2 has no tokenizer"):
        tokenizer_folder("tiny-qwen2")
    with pytest.raises(ModelError, match="unknown model"):
        tokenizer_folder(str(tmp_path / "missing"))


def test_prepare_data_refuses_a_model_without_tokenizer(folders, tmp_path):
    config_only, _ = folders["config-only"]
    run = subprocess.run(
        [sys.executable, str(REPO / "launch" / "prepare_data.py"), "--model", str(config_only), "--out",
         str(tmp_path / "out"), "--seqlen", "128"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {config_only} has no tokenizer"), run.stderr
    assert not (tmp_path / "out").exists()


def test_registered_and_unknown_names(tmp_path):
    spec = resolve_model("tiny-qwen2", vocab_size=VOCAB, max_positions=4096)
    c = spec.config
    assert (spec.pretrained, spec.tokenizer_dir, c.vocab_size, c.max_position_embeddings) == (False, None, VOCAB, 4096)
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.use_cache) == (4, 256, 4, False)
    with pytest.raises(ModelError, match="tiny-qwen2 is built for its length"):
        resolve_model("tiny-qwen2", rope=RopeScaling(kind="yarn", factor=2.0))
    with pytest.raises(ModelError, match="choose one of tiny-qwen2, smollm2-135m, or pass a Hugging Face folder"):
        resolve_model("no-such-model")
    with pytest.raises(ModelError, match="choose one of"):
        resolve_model(str(tmp_path))  # a folder without config.json
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    with pytest.raises(ModelError, match="not a transformers model config"):
        resolve_model(str(tmp_path))


UNSUPPORTED = [
    pytest.param(MistralConfig(**TINY), "sliding-window attention", "sliding_window=4096 on 2 of 2 layers",
                 id="mistral-default-window"),
    pytest.param(Qwen2Config(**TINY, use_sliding_window=True, max_window_layers=1), "sliding-window attention",
                 "sliding_window=4096 on 1 of 2 layers", id="qwen2-window-from-layer-1"),
    pytest.param(Gemma2Config(**TINY), "attention-logit soft-capping", "attn_logit_softcapping=50.0", id="softcap"),
    pytest.param(GPT2Config(n_embd=128, n_head=2, n_layer=2), "a position encoding without RoPE",
                 "no rope_parameters", id="no-rope"),
    pytest.param(LlamaConfig(**(TINY | {"hidden_size": 192})), "a head dim the kernels lack", "head_dim=96",
                 id="head-dim-96"),
    pytest.param(BertConfig(), "a non-causal-LM architecture", "bert is an encoder", id="bert"),
    pytest.param(FalconConfig(), "its attention code", "FalconForCausalLM does not dispatch through", id="falcon"),
    pytest.param(LlamaConfig(**TINY, attention_dropout=0.1), "attention dropout", "attention_dropout=0.1",
                 id="dropout"),
]  # fmt: skip


@pytest.mark.parametrize("config,feature,detail", UNSUPPORTED)
def test_unsupported_features_fail_in_one_line(config, feature, detail):
    with pytest.raises(UnsupportedModelError) as error:
        check_supported(config, "some-model")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"some-model: {feature} (") and detail in message
    assert ") is not supported by the sparse attention; " in message


def test_unsupported_folder_is_refused_by_resolve(tmp_path):
    MistralConfig(**TINY).save_pretrained(tmp_path / "mistral-v0.1-like")
    with pytest.raises(UnsupportedModelError) as error:
        resolve_model(str(tmp_path / "mistral-v0.1-like"))
    assert str(error.value) == (
        "mistral-v0.1-like: sliding-window attention (sliding_window=4096 on 2 of 2 layers) is not supported by "
        "the sparse attention; set sliding_window to null (Qwen2/Qwen3: use_sliding_window false)"
    )


@pytest.mark.parametrize(
    "config,windowed",
    [
        pytest.param(MistralConfig(**TINY), True, id="mistral-default"),
        pytest.param(Qwen2Config(**TINY, use_sliding_window=True, max_window_layers=1), True, id="qwen2-from-1"),
        pytest.param(Qwen2Config(**TINY, use_sliding_window=True, max_window_layers=2), False, id="qwen2-from-2"),
        pytest.param(Qwen3Config(**TINY, head_dim=64, sliding_window=8), False, id="qwen3-window-unused"),
        pytest.param(MistralConfig(**TINY, sliding_window=None), False, id="mistral-no-window"),
    ],
)
def test_sliding_window_check_agrees_with_what_transformers_applies(config, windowed):
    """The check rejects exactly the configs for which transformers hands our attention function a window."""
    rejected = False
    try:
        check_supported(config, "m")
    except UnsupportedModelError:
        rejected = True
    model = AutoModelForCausalLM.from_config(config, attn_implementation="mtraining")
    ids = torch.randint(0, VOCAB, (1, 64))
    try:
        model(ids, mtraining=MTrainingAttention(DENSE))
        applied = False
    except ValueError as e:
        assert "sliding-window" in str(e)
        applied = True
    assert rejected == applied == windowed


def test_shipped_qwen25_3b_config():
    spec = resolve_model(str(REPO / "model_configs" / "qwen2.5-3b"))
    c = spec.config
    assert (spec.name, spec.pretrained, spec.tokenizer_dir) == ("qwen2.5-3b", False, None)
    assert type(c) is Qwen2Config and c.architectures == ["Qwen2ForCausalLM"]
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (36, 2048, 11008, 151936)
    assert (c.num_attention_heads, c.num_key_value_heads, c.hidden_size // c.num_attention_heads) == (16, 2, 128)
    assert (c.rope_parameters["rope_theta"], c.rms_norm_eps, c.tie_word_embeddings) == (1e6, 1e-6, True)
    assert (c.max_position_embeddings, c.sliding_window, c.dtype, c.use_cache) == (32768, None, torch.bfloat16, False)
    with torch.device("meta"):  # the shape without 12 GB of fp32 weights
        model = AutoModelForCausalLM.from_config(c)
    assert sum(p.numel() for p in model.parameters()) == 3_085_938_688  # Qwen2.5-3B's published 3.09B
    stretched = resolve_model(str(REPO / "model_configs" / "qwen2.5-3b"), rope=RopeScaling(kind="yarn", factor=2.0))
    assert stretched.config.max_position_embeddings == 65536 and c.max_position_embeddings == 32768


def test_export_round_trip(folders, tmp_path):
    folder, _ = folders["llama"]
    spec = resolve_model(str(folder))
    model = spec.build(seed=0)
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)  # not the folder's weights any more
    out = export_hf_folder(model, model.config, spec.tokenizer_dir, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary sibling left
    assert "mtraining" not in (out / "config.json").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert _equal(loaded.state_dict(), model.state_dict())
    assert loaded.config.use_cache is True and loaded.config._attn_implementation == "sdpa"
    assert AutoTokenizer.from_pretrained(out)("w5 w95 zz")["input_ids"] == [5, 95, 0]
    with pytest.raises(FileExistsError):
        export_hf_folder(model, model.config, None, out)


def test_export_writes_tied_weights_once(tmp_path):
    from safetensors import safe_open

    spec = resolve_model("tiny-qwen2", vocab_size=VOCAB, max_positions=1024)  # tied embeddings
    state = {k: v.clone() for k, v in spec.build(seed=0).state_dict().items()}  # tied names, separate tensors
    out = export_hf_folder(state, spec.config, None, tmp_path / "hf")
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert _equal(AutoModelForCausalLM.from_pretrained(out).state_dict(), state)


def export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "launch" / "export.py"), *args],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def refused(capsys, script: str, *args: str) -> str:
    """``script``'s (``"train"`` or ``"export"``) ``main`` on ``args`` in this process, which must refuse them
    (``train_job.refusal``): the error line (a refusal comes before any engine; a process of its own would spend its
    10 s importing)."""
    if script == "train":
        from ds_mtraining.training.cli import main

        args = ("--seqlen", SEQLEN, *args)
    else:
        main = runpy.run_path(str(REPO / "launch" / "export.py"))["main"]
    capsys.readouterr()  # what the test printed before
    return refusal(main(list(args)), capsys.readouterr())


def test_export_of_a_deepspeed_checkpoint(tmp_path, capsys):
    """One ZeRO-2 step of launch/train.py, then launch/export.py: the folder holds the checkpoint's weights."""
    run, out = tmp_path / "run", tmp_path / "hf"
    train("--deepspeed", str(write_config(tmp_path / "ds.json")), "--steps", "1", "--save-interval", "1",
          "--output-dir", str(run))  # fmt: skip
    result = export("--checkpoint", str(run / "checkpoints"), "--model", "tiny-qwen2", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    saved = torch.load(run / "checkpoints" / "step1" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert _equal(loaded.state_dict(), saved)
    assert loaded.config.vocab_size == 512 and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    initial = resolve_model("tiny-qwen2", vocab_size=512, max_positions=8192).build(seed=0).state_dict()
    assert not torch.equal(initial["model.layers.0.mlp.up_proj.weight"], saved["model.layers.0.mlp.up_proj.weight"])
    missing = refused(capsys, "export", "--checkpoint", str(run / "checkpoints"), "--tag", "step9", "--model",
                      "tiny-qwen2", "--out", str(tmp_path / "other"))  # fmt: skip
    assert missing.startswith("error: checkpoint ")


def test_train_job_takes_a_folder_and_refuses_an_unsupported_one(folders, tmp_path, capsys):
    """``launch/train.py --model FOLDER``: the folder's own architecture and vocabulary (synthetic copies: it has no
    tokenizer), trained one ZeRO-2 step; a windowed Mistral folder ends in one ``error:`` line, nothing written."""
    folder, _ = folders["qwen2"]
    out = tmp_path / "run"
    result = train("--model", str(folder), "--deepspeed", str(write_config(tmp_path / "ds.json")), "--steps", "1",
                   "--no-save", "--output-dir", str(out))  # fmt: skip
    assert "model     qwen2 (weights loaded): 2 layers, hidden 128, heads 2 (KV 1), vocab 96" in result.stdout
    assert "synthetic long-range copies" in result.stdout
    (record,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert math.isfinite(record["loss"]) and len(record["density"]) == 2
    windowed = tmp_path / "mistral-v0.1"
    MistralConfig(**TINY, sliding_window=4096).save_pretrained(windowed)
    assert refused(capsys, "train", "--model", str(windowed), "--output-dir", str(tmp_path / "no")) == (
        "error: mistral-v0.1: sliding-window attention (sliding_window=4096 on 2 of 2 layers) is not supported by the "
        "sparse attention; set sliding_window to null (Qwen2/Qwen3: use_sliding_window false)"
    )
    assert not (tmp_path / "no").exists()


def test_rope_stretch_is_kept_through_resume_and_export(tmp_path, capsys):
    """The stretch a run trains with is in every manifest and the banner; a resume with another one is refused in one
    line; export writes it without being told and refuses flags that contradict it; a manifest written before it was
    recorded leaves it to the flags."""
    run, config, model = tmp_path / "run", str(write_config(tmp_path / "ds.json")), tmp_path / "model"
    Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=256).save_pretrained(model)  # fmt: skip
    first = train("--deepspeed", config, "--model", str(model), "--steps", "1", "--save-interval", "1",
                  "--output-dir", str(run), "--rope-kind", "yarn", "--rope-factor", "2")  # fmt: skip
    assert "RoPE yarn x2" in first.stdout
    manifest_path = run / "checkpoints" / "step1" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert (manifest["settings"]["rope_kind"], manifest["settings"]["rope_factor"]) == ("yarn", 2.0)

    resume = ("--deepspeed", config, "--model", str(model), "--steps", "2", "--output-dir", str(run), "--resume")
    line = refused(capsys, "train", *resume, "--rope-kind", "linear", "--rope-factor", "2")
    assert line.startswith("error: checkpoint ") and "rope_kind yarn (this run: linear)" in line, line
    assert "resume with the checkpoint's values (--rope-kind yarn --rope-factor 2)" in line, line
    assert refused(capsys, "train", *resume) == (
        f"error: --seqlen 512 is past model's context of 256 tokens; checkpoint {run / 'checkpoints' / 'step1'} "
        "trained with --rope-kind yarn --rope-factor 2: resume with --rope-kind yarn --rope-factor 2"
    )
    # within the model's context: no stretch needed, and none given
    assert "rope_kind yarn (this run: None)" in refused(capsys, "train", *resume, "--seqlen", "256")

    out = tmp_path / "hf"
    done = export("--checkpoint", str(run / "checkpoints"), "--model", str(model), "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rope = AutoConfig.from_pretrained(out).rope_parameters
    assert (rope["rope_type"], rope["factor"]) == ("yarn", 2.0), rope
    line = refused(capsys, "export", "--checkpoint", str(run / "checkpoints"), "--model", str(model), "--out",
                   str(tmp_path / "x"), "--rope-kind", "linear")  # fmt: skip
    assert line.startswith("error: checkpoint ") and "--rope-kind yarn --rope-factor 2" in line
    assert not (tmp_path / "x").exists()

    for key in ("rope_kind", "rope_factor"):  # as written before the stretch was recorded
        del manifest["settings"][key]
    manifest_path.write_text(json.dumps(manifest))
    old = export("--checkpoint", str(run / "checkpoints"), "--model", str(model), "--out", str(tmp_path / "old"),
                 "--rope-kind", "linear", "--rope-factor", "2")  # fmt: skip
    assert old.returncode == 0, old.stderr[-3000:]
    assert AutoConfig.from_pretrained(tmp_path / "old").rope_parameters["rope_type"] == "linear"

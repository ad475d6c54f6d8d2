"""ZeRO stages 1, 2 and 3 with every parallel shape against one process without DeepSpeed.

Every rank builds the same tiny fp32 Qwen2 and trains a copy of it in plain torch on the whole sequences (the
single-process reference: ``forward_loss`` on the full batch, averaged over the data-parallel ranks' batches,
``torch.optim.AdamW``, the same clipping), then the training job's path on its shard: a DeepSpeed engine built
as ``ds_mtraining.training.Trainer`` builds it (``mpu=MeshMPU(mesh)``, activation checkpointing), ``make_batch``,
``forward_loss``, ``engine.backward``, ``engine.step``. After step 1 every parameter's full gradient
(``safe_get_full_grad``, before the step) and after step 2 every fp32 weight (``safe_get_full_fp32_param``) must
equal the reference's, and so must the losses (summed over SP, averaged over DP).

ZeRO-3 runs with ``stage3_param_persistence_threshold: 0``: the tiny model's parameters would otherwise all be
"persistent" (never partitioned, under 100K elements each) and the partitioned path would go untested.

Tolerances (fp32): the sharded run sums attention, matmuls and gradients in another order (per SP shard, per
ZeRO partition, reduce across ranks), which moves fp32 results by a few ulp (measured: relative error of the
gradients < 1e-5 for the largest entries). Adam's first steps divide by ``sqrt(v)``, about ``|g|``, which turns a
relative gradient error into the same absolute error of ``lr * update`` (lr 1e-3): the weights after two steps
agree within ``atol 1e-6`` only because ``eps`` (1e-6 here) damps the entries whose gradient is below it.
A wrong reduction (averaged instead of summed over SP, or a missing contribution) is off by a factor of 2 or more.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from test_train_parallel import sequence_parallel_config, tiny_qwen2  # the training-parallel tests' cases

N = 256  # stripes of 64 over 2 and 4 ring ranks, and a shard that 2 Ulysses ranks split
LR, BETAS, EPS, DECAY, CLIP = 1e-3, (0.9, 0.95), 1e-6, 0.1, 1.0
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
WEIGHT_TOL = {"rtol": 1e-4, "atol": 1e-6}


def _tokens(step: int, dp_index: int) -> torch.Tensor:
    return torch.randint(3, 64, (1, N), generator=torch.Generator().manual_seed(1000 * step + dp_index))


def _ds_config(stage: int, accumulation: int, extra: dict | None = None) -> dict:
    zero = {"stage": stage, "contiguous_gradients": True, "overlap_comm": False, "reduce_bucket_size": 5000}
    zero |= extra or {}
    if stage == 3:
        zero |= {"stage3_param_persistence_threshold": 0, "stage3_model_persistence_threshold": 0}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": CLIP,
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": DECAY, "torch_adam": True},
        },
        "steps_per_print": 1000,
    }


def _reference(tied: bool, sparse_config, dp: int, accumulation: int):
    """Two steps in plain torch on the whole sequences: losses, gradients of step 1, weights after step 2."""
    from ds_mtraining.integration.batch import make_batch
    from ds_mtraining.integration.loss import forward_loss
    from ds_mtraining.integration.transformers import MTrainingAttention

    model = tiny_qwen2(tied=tied)
    model.train()
    attention = MTrainingAttention(sparse_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY)
    losses, grads = [], None
    for step in range(2):
        optimizer.zero_grad()
        total = 0.0
        for micro in range(accumulation):
            for d in range(dp):
                batch = make_batch(_tokens(step * accumulation + micro, d), mesh=None, layout=None, pad_id=0)
                loss = forward_loss(model, batch, attention) / (dp * accumulation)
                loss.backward()
                total += float(loss.detach())
        losses.append(total)
        if step == 0:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
    return losses, grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def _worker(rank: int, world: int, stage, ulysses, ring, inner, local_world, tied, sparse, accumulation, extra) -> None:
    import logging
    import os

    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from ds_mtraining.integration.batch import make_batch
    from ds_mtraining.integration.recompute import enable_activation_checkpointing
    from ds_mtraining.integration.deepspeed import MeshMPU, sum_sequence_parallel_gradients
    from ds_mtraining.integration.loss import forward_loss
    from ds_mtraining.integration.transformers import MTrainingAttention
    from ds_mtraining.parallel.mesh import Mesh, MeshShape

    os.environ["LOCAL_RANK"] = str(rank)  # what a launcher sets; this process's group exists already
    deepspeed.utils.logger.setLevel(logging.ERROR)
    config = sequence_parallel_config(ulysses, ring, inner, sparse)
    shape = MeshShape.build(
        world=world, ulysses=ulysses, ring=ring, q_heads=4, kv_heads=2, inner_ring=inner, local_world_size=local_world
    )
    ref_losses, ref_grads, ref_weights = _reference(tied, config.sparse_attention, shape.dp, accumulation)

    mesh = Mesh(shape)
    layout = shape.layout(N, kind="striped", block_size=64, stripe=None) if shape.sp > 1 else None
    attention = MTrainingAttention(config.sparse_attention, mesh=mesh, layout=layout)
    model = tiny_qwen2(tied=tied)
    enable_activation_checkpointing(model)
    model.train()
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=_ds_config(stage, accumulation, extra),
        mpu=MeshMPU(mesh),
    )
    sum_sequence_parallel_gradients(engine)  # as the Trainer does
    where = f"rank {rank}, ZeRO-{stage}, {shape.describe()}, tied={tied}, sparse={sparse}"
    losses, grads = [], None
    for step in range(2):
        total = torch.zeros((), dtype=torch.float64)
        for micro in range(accumulation):
            tokens = _tokens(step * accumulation + micro, mesh.dp_index)
            batch = make_batch(tokens, mesh=mesh, layout=layout, pad_id=0)
            loss = forward_loss(engine, batch, attention)
            engine.backward(loss)
            if step == 0 and micro == accumulation - 1:  # at the boundary, before the step
                grads = {name: safe_get_full_grad(p).clone() for name, p in engine.module.named_parameters()}
            engine.step()
            total += loss.detach().double()
        dist.all_reduce(total)  # loss parts sum over SP; DP and accumulation average
        losses.append(float(total) / (shape.dp * accumulation))

    assert sorted(grads) == sorted(ref_grads), where
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **GRAD_TOL, msg=lambda m, n=name: f"grad {n} {where}: {m}")
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=0), f"losses {losses} != {ref_losses}: {where}"
    for name, p in engine.module.named_parameters():
        weight = safe_get_full_fp32_param(p)
        assert weight is not None and weight.shape == ref_weights[name].shape, f"{name} {where}"
        torch.testing.assert_close(
            weight, ref_weights[name], **WEIGHT_TOL, msg=lambda m, n=name: f"weight {n} {where}: {m}"
        )


ALLREDUCE = {"reduce_scatter": False, "reduce_bucket_size": 20000}
# (world, stage, ulysses, ring, inner_ring_size, LOCAL_WORLD_SIZE, tied, sparse, accumulation, zero_optimization extra)
CASES = [
    pytest.param(2, 1, 2, 1, None, None, False, False, 1, None, id="zero1-ulysses2"),
    pytest.param(2, 2, 2, 1, None, None, False, False, 1, None, id="zero2-ulysses2"),
    pytest.param(2, 3, 2, 1, None, None, False, False, 1, None, id="zero3-ulysses2"),
    pytest.param(2, 1, 1, 2, None, None, False, False, 1, None, id="zero1-ring2"),
    pytest.param(2, 2, 1, 2, None, None, True, False, 1, None, id="zero2-ring2-tied"),
    pytest.param(2, 3, 1, 2, None, None, True, True, 2, None, id="zero3-ring2-tied-sparse-accum2"),
    pytest.param(2, 3, 1, 1, None, None, False, False, 1, None, id="zero3-dp2"),
    pytest.param(4, 1, 2, 2, None, None, False, False, 1, None, id="zero1-ulysses2-ring2"),
    pytest.param(4, 2, 2, 2, None, None, False, False, 1, None, id="zero2-ulysses2-ring2"),
    pytest.param(4, 3, 2, 2, None, None, False, False, 1, None, id="zero3-ulysses2-ring2"),
    pytest.param(4, 3, 1, 4, None, 2, False, False, 1, None, id="zero3-ring4-hierarchical"),
    pytest.param(4, 2, 2, 2, 1, None, False, False, 1, None, id="zero2-ulysses2-ring2-hierarchical"),
    pytest.param(4, 2, 2, 1, None, None, False, False, 1, None, id="zero2-dp2-ulysses2"),
    pytest.param(4, 3, 2, 1, None, None, True, False, 1, None, id="zero3-dp2-ulysses2-tied"),
    pytest.param(4, 1, 1, 2, None, None, False, False, 1, None, id="zero1-dp2-ring2"),
    # ZeRO-3's all-reduce path (sums over SP itself): every bucket within reduce_bucket_size
    pytest.param(2, 3, 2, 1, None, None, False, False, 1, ALLREDUCE, id="zero3-ulysses2-allreduce"),
]


@pytest.mark.parametrize("world,stage,ulysses,ring,inner,local_world,tied,sparse,accumulation,extra", CASES)
def test_zero_stage_equals_single_process(
    world, stage, ulysses, ring, inner, local_world, tied, sparse, accumulation, extra
):
    args = (stage, ulysses, ring, inner, local_world, tied, sparse, accumulation, extra)
    run_distributed(world, _worker, *args, timeout=180)


def _one_rank_losses(rank: int, world: int, out) -> None:
    import logging
    import os

    import deepspeed

    from ds_mtraining.config import SparseAttentionConfig
    from ds_mtraining.integration.batch import make_batch
    from ds_mtraining.integration.recompute import enable_activation_checkpointing
    from ds_mtraining.integration.loss import forward_loss
    from ds_mtraining.integration.transformers import MTrainingAttention

    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.utils.logger.setLevel(logging.ERROR)
    attention = MTrainingAttention(SparseAttentionConfig(pattern="dense"))
    losses = {}
    for stage in (2, 3):
        model = tiny_qwen2(tied=True)
        enable_activation_checkpointing(model)
        model.train()
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=_ds_config(stage, accumulation=1)
        )
        losses[stage] = []
        for step in range(3):
            loss = forward_loss(engine, make_batch(_tokens(step, 0), mesh=None, layout=None, pad_id=0), attention)
            engine.backward(loss)
            engine.step()
            losses[stage].append(float(loss))
        engine.destroy()
    assert losses[3] == pytest.approx(losses[2], rel=1e-5), losses
    assert losses[2][2] < losses[2][0]  # it trains


def test_zero3_one_rank_matches_zero2():
    """One rank, no mpu: ZeRO-3 (partitioned head, tied embedding) gives ZeRO-2's losses over 3 steps."""
    run_distributed(1, _one_rank_losses, None, timeout=120)


def test_train_job_with_zero3_and_cpu_offload_resumes_exactly(tmp_path):
    """``launch/train.py`` itself under ZeRO-3 + CPU optimizer offload: it trains (the tiled loss gathers the
    partitioned head), checkpoints, and a resume from step 2 continues to the same losses as one run."""
    import json

    from test_train import metrics, train, write_config

    config = write_config(tmp_path / "config.json")
    data = json.loads(config.read_text())
    data["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    config.write_text(json.dumps(data))
    full, cut = tmp_path / "full", tmp_path / "cut"
    train("--deepspeed", str(config), "--steps", "3", "--output-dir", str(full))
    train("--deepspeed", str(config), "--steps", "2", "--output-dir", str(cut))
    train("--deepspeed", str(config), "--steps", "3", "--resume", "--output-dir", str(cut))
    assert [r["loss"] for r in metrics(cut)] == [r["loss"] for r in metrics(full)]
    assert len({r["loss"] for r in metrics(full)}) == 3  # it trains: every step's loss differs


def _own_loop_worker(rank: int, world: int, ulysses: int, ring: int, corrected: bool) -> None:
    """A training loop of one's own from the package's pieces: ``MeshMPU``, ``make_batch``, the model called with
    ``mtraining=``, ``sequence_loss`` on its full logits, ZeRO-3. Corrected (``sum_sequence_parallel_gradients``), its
    gradients are one process's; not, the first training forward is refused in one line (before the correction
    existed they came out 1/SP of their value, the loss right)."""
    import logging
    import os

    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from ds_mtraining.config import ConfigError
    from ds_mtraining.integration.batch import make_batch, sequence_loss
    from ds_mtraining.integration.deepspeed import MeshMPU, sum_sequence_parallel_gradients
    from ds_mtraining.integration.transformers import MTrainingAttention
    from ds_mtraining.parallel.mesh import Mesh, MeshShape

    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.utils.logger.setLevel(logging.ERROR)
    config = sequence_parallel_config(ulysses, ring, None, False)
    shape = MeshShape.build(world=world, ulysses=ulysses, ring=ring, q_heads=4, kv_heads=2)
    _, ref_grads, _ = _reference(False, config.sparse_attention, shape.dp, 1)
    mesh = Mesh(shape)
    layout = shape.layout(N, kind="striped", block_size=64, stripe=None)
    attention = MTrainingAttention(config.sparse_attention, mesh=mesh, layout=layout)
    model = tiny_qwen2()
    model.train()
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_ds_config(3, 1), mpu=MeshMPU(mesh)
    )
    if corrected:
        assert sum_sequence_parallel_gradients(engine) == shape.sp  # DeepSpeed's reduce-scatter averages over SP
    batch = make_batch(_tokens(0, mesh.dp_index), mesh=mesh, layout=layout, pad_id=0)

    def loss() -> torch.Tensor:
        logits = engine(batch.input_ids, position_ids=batch.position_ids, use_cache=False, mtraining=attention).logits
        return sequence_loss(logits, batch.labels, batch.label_tokens)

    if not corrected:
        with pytest.raises(ConfigError, match=r"^ZeRO-3 with sequence parallelism: .*sum_sequence_parallel_gradients"):
            loss()
        return
    engine.backward(loss())
    grads = {name: safe_get_full_grad(p) for name, p in engine.module.named_parameters()}
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **GRAD_TOL, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize("corrected", [True, False], ids=["corrected", "refused"])
@pytest.mark.parametrize("ulysses,ring", [(1, 2), (2, 1)], ids=["ring2", "ulysses2"])
def test_own_loop_with_sequence_loss_under_zero3(ulysses, ring, corrected):
    run_distributed(2, _own_loop_worker, ulysses, ring, corrected, timeout=180)

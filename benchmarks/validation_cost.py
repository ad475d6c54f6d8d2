"""What ``vertical_slash_attention``'s index validation costs on a GPU, alone and in a chain of layers.

    python benchmarks/validation_cost.py

``VerticalSlashIndex.validate`` synchronises with the host (four ``.any()`` checks). Alone, a sync costs little:
the GPU drains the queue either way. In a model the host launches layer after layer ahead of the GPU, and each
sync makes it wait, so the next layer's launches are no longer hidden behind the GPU's work. Times at 128K, B=1,
16 query / 2 kv heads of 128, bf16, H200: fwd+bwd through autograd on a planted 5 %-dense index, and 4 "layers"
(the spread estimate, then the attention forward; one backward through all four), with ``check_index`` True and
False, alternated three times (medians of ``triton.testing.do_bench``).
"""

import argparse
import sys
from pathlib import Path

import torch
import triton.testing

import ds_mtraining.sparse.triton as vs
from ds_mtraining.estimator import estimate_index
from ds_mtraining.sparse import vertical_slash_attention
from ds_mtraining.sparse.planted import planted_index

sys.path.insert(0, str(Path(__file__).resolve().parent))
from estimator_bench import GRAPHS, STRATEGIES, _inputs


def bench(fn, rep: int = 300) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options: --help only
    n = 131072
    gen = torch.Generator().manual_seed(0)
    q, k, v = _inputs(n, gen)
    scale = 128**-0.5
    index = planted_index(1, 16, n, 128, density=0.05, generator=gen, device="cuda")
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)
    config = STRATEGIES["spread"]

    def kernel_path():
        kidx = vs.prepare_index(index, n)
        out, lse = vs.vertical_slash_forward(q, k, v, kidx, scale)
        vs.vertical_slash_backward(do, q, k, v, out, lse, kidx, scale)

    def autograd_path(check: bool):
        out = vertical_slash_attention(qg, kg, vg, index, check_index=check)
        torch.autograd.grad(out, (qg, kg, vg), do)

    def layers(check: bool):
        total = 0
        for _ in range(4):
            idx = estimate_index(q, k, config, graphs=GRAPHS)
            total = total + vertical_slash_attention(qg, kg, vg, idx, check_index=check).float().square().mean()
        torch.autograd.grad(total, (qg, kg, vg))

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| case | check_index=True ms | check_index=False ms | difference |")
    print("|---|---|---|---|")
    print(f"| kernel API fwd+bwd (no validation) | {bench(kernel_path):.2f} | | |")
    cases = (("autograd fwd+bwd", autograd_path, 1500), ("4 layers estimate + attention fwd+bwd", layers, 4000))
    for name, fn, rep in cases:
        for _ in range(3):  # alternating: the difference must repeat
            with_check, without = bench(lambda fn=fn: fn(True), rep), bench(lambda fn=fn: fn(False), rep)
            diff = f"{with_check - without:+.2f} ({with_check / without - 1:+.1%})"
            print(f"| {name} | {with_check:.2f} | {without:.2f} | {diff} |", flush=True)
    idx = estimate_index(q, k, config, graphs=GRAPHS)
    print(f"validate alone: {bench(lambda: idx.validate(n)):.2f} ms")


if __name__ == "__main__":
    main()

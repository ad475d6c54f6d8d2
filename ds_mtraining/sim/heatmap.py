"""The simulator's heatmap (``--heatmap``): the kernel time of each (ring rank, step) of one plan's ring, forward and
backward, as a PNG whose title (also its ``Title`` metadata) names the plan."""

from __future__ import annotations

from pathlib import Path

from .cluster import AttentionSim

__all__ = ["draw_heatmap"]


def draw_heatmap(attention: AttentionSim, path: Path, world: int, what: str) -> None:
    """Write ``path``: ``attention``'s forward and backward compute (``[R, S]`` ms each, ``R`` ring ranks: under
    Ulysses each rank a group of GPUs, the slowest head group's; ``S = R`` steps, or ``R / g`` all-gathered calls) on
    ``world`` GPUs; ``what`` says why this plan (e.g. "the fastest predicted plan")."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster's login node
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    title = f"{attention.plan.name}, {what}: kernel ms per (ring rank, step), {world} GPUs"
    fig, axes = plt.subplots(1, 2, figsize=(10.0, 4.2), layout="constrained")
    for ax, (name, timeline) in zip(axes, (("forward", attention.forward), ("backward", attention.backward))):
        im = ax.imshow(timeline.compute.numpy(), vmin=0, cmap="viridis", aspect="auto")
        ax.set(title=name, xlabel="ring step", ylabel="ring rank")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        fig.colorbar(im, ax=ax, label="ms")
    fig.suptitle(title.replace(": ", ":\n", 1))
    fig.savefig(path, dpi=110, metadata={"Title": title})
    plt.close(fig)

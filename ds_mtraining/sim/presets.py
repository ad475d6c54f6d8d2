"""The simulator's named clusters (``--topology``): each a node of 8 GPUs, its links, its cards' memory and its RAM.

Bandwidths are one direction per GPU (what one ring hop uses), from the vendors' figures; latencies (10 µs a
transfer inside a node, 20 µs across) are assumed, not measured. Memory is what PyTorch reports for the card
(``torch.cuda.get_device_properties(i).total_memory / 2**30``), what the memory estimate is compared with. A node's
RAM (``host_gib``, what its ranks' pinned checkpoints and offloaded optimizer state are compared with) is the DGX
systems' figure: 1 TiB in a DGX A100, 2 TiB in a DGX H100 and a DGX H200 (NVIDIA's datasheets); an HGX node built by
another vendor may have more or less (``--host-gib``).
"""

from __future__ import annotations

from .timeline import Topology

__all__ = ["PRESETS"]

PRESETS = {
    "a100": Topology(8, 300.0, 10.0, 25.0, 20.0, memory_gib=79.1, host_gib=1024.0),  # DGX A100: 1 TiB
    "h100": Topology(8, 450.0, 10.0, 50.0, 20.0, memory_gib=79.1, host_gib=2048.0),  # DGX H100: 2 TiB
    "h200": Topology(8, 450.0, 10.0, 50.0, 20.0, memory_gib=139.8, host_gib=2048.0),  # DGX H200: 2 TiB
}
"""- ``a100``: the MTraining paper's cluster: A100 80 GB, NVLink 3 at 600 GB/s both directions (300 a direction),
  InfiniBand at 200 Gb/s = 25 GB/s a GPU.
- ``h100``: an HGX / DGX H100 node, the GPU the step costs (``sim.CALIBRATED``) were fitted on: H100 SXM5 80 GB
  HBM3; NVLink 4, 18 links for 900 GB/s both directions (NVIDIA H100 Tensor Core GPU datasheet), 450 GB/s a
  direction through the node's NVSwitches; one ConnectX-7 at 400 Gb/s InfiniBand NDR a GPU (DGX H100 datasheet:
  8 single-port ConnectX-7 for 8 GPUs), 50 GB/s a direction.
- ``h200``: an HGX H200 node: the same NVLink 4 and 400 Gb/s a GPU, H200's 141 GB HBM3e (139.8 GiB reported on
  the H200s ``memory`` was fitted on).
"""

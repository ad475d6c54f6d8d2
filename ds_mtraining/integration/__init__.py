"""Adapters to the libraries underneath: transformers (the attention registration and handle, model loading,
recomputation, export), DeepSpeed (config checks, the engine's mpu and gradient plumbing, TiledMLP), Liger Kernel
(fused kernels), and the batch and loss a model with the sparse attention trains on. The run itself (checkpoints,
manifest, stops, metrics) is :mod:`ds_mtraining.training`."""

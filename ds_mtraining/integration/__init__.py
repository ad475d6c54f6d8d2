"""Adapters to the outside: transformers attention registration, DeepSpeed engine/mpu/checkpoints, data path."""

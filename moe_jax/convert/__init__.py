"""Hugging Face checkpoints in and out: `python -m moe_jax.convert import|export`."""

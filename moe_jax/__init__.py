"""moe_jax: communication-efficient Mixture-of-Experts training on JAX."""

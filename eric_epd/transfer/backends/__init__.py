"""Transfer backends; each has a producer side (inside Eric, over the pool) and a consumer side."""

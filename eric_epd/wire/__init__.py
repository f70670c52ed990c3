"""Wire schemas, one module per process boundary, imported by both sides of it."""

"""Offline random checkpoints built from each family's real configs: the built-in demo models."""

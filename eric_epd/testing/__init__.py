"""Offline test fixtures shared by tests, benchmarks and the default model."""

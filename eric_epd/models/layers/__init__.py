"""Tensor-parallel building blocks shared by the vision encoders."""

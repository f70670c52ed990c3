"""Geri: Eric's twin, embeddings in and generated images out (Qwen-Image's transformer, scheduler and VAE)."""

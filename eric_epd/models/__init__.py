"""Vision encoders, modality processors and the model registry of the Eric encode server."""

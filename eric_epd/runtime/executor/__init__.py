"""Engine-side model executor: worker processes and the shared-memory batch broadcast."""

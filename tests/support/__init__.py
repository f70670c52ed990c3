"""Helpers shared by the test folders (imported as tests.support.<module>): engine and service stand-ins, live-server
helpers, the SGLang prefill harness and probes, shm broadcast reader processes, and the gateway's placement."""

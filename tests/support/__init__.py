"""Helpers shared by the test folders (imported as tests.support.<module>): engine and service stand-ins, live-server
helpers, the SGLang prefill harness and probes, shm broadcast reader processes, the gateway's placement, and the
README's figures as their benchmark JSONs state them (readme_*)."""

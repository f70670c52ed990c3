"""eric-epd: encoder-prefill-decode disaggregation; Eric is the standalone multimodal encode server."""

__version__ = "0.1.0"

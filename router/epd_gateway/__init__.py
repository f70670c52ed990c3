"""The EPD/PD gateway: an OpenAI-compatible front door that sends multi-image requests through Eric."""

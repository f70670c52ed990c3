"""Engine plugins: vLLM (encoder-cache connector) and SGLang (encoder-disaggregation protocol)."""

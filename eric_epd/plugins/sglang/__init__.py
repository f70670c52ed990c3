"""SGLang plugin: Eric as the encoder behind `--language-only --encoder-urls` (routes.py and encoder.py, mounted in
Eric) and NIXL as an encoder transfer backend on SGLang's prefill side (plugin.py, the `sglang.srt.plugins` entry
point)."""

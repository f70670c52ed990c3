"""SGLang plugin, run inside SGLang: NIXL as an encoder transfer backend on its prefill side (plugin.py, the
`sglang.srt.plugins` entry point). Eric's side of SGLang's encoder protocol is eric_epd/eric/sglang."""

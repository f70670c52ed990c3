"""Eric's side of SGLang's encoder-disaggregation protocol (routes, state machine, ZMQ/Mooncake/NIXL push), mounted
in Eric's router; the plugin that runs inside SGLang is eric_epd/plugins/sglang."""

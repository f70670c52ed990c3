"""The test suite, one pytest process per test folder (tests/<component>), one folder after another.

No folder's tests run in a process that another folder's tests have changed. On CPU, the in-process transformers
references of tests/models ran 3 to 100 times slower once tests/gateway had run in the same process, so every
folder gets a fresh process. A folder's session servers also stop before the next folder starts. Checkpoints are
built once, into one cache the processes share. Extra arguments go to every pytest. The exit status is non-zero if
any folder failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_TESTS = 5
"""pytest's exit status when a folder has no test to run (tests/cuda on a CPU host: deselected by marker)."""


def folders() -> list[Path]:
    """The test folders, in the order a single `pytest tests` would run them."""
    return sorted(
        p
        for p in (ROOT / "tests").iterdir()
        if p.is_dir() and p.name != "support" and not p.name.startswith((".", "_"))
    )


def main(args: list[str]) -> int:
    """Run each folder's tests in a process of its own; print a table of outcomes and times; 0 if all passed."""
    with tempfile.TemporaryDirectory(prefix="eric-test-cache-") as cache:
        env = {**os.environ, "ERIC_EPD_TEST_CACHE": os.environ.get("ERIC_EPD_TEST_CACHE") or cache}
        results: list[tuple[str, int, float]] = []
        for folder in folders():
            start = time.monotonic()
            code = subprocess.call(
                [sys.executable, "-m", "pytest", str(folder.relative_to(ROOT)), *args], cwd=ROOT, env=env
            )
            results.append((folder.name, code, time.monotonic() - start))
    failed = [name for name, code, _ in results if code not in (0, NO_TESTS)]
    sys.stdout.write("\nfolder        status   minutes\n")
    for name, code, seconds in results:
        status = "ok" if code in (0, NO_TESTS) else f"exit {code}"
        sys.stdout.write(f"{name:<13} {status:<8} {seconds / 60:7.1f}\n")
    sys.stdout.write(
        f"total {sum(s for *_, s in results) / 60:.1f} min; "
        f"{'failed: ' + ', '.join(failed) if failed else 'every folder passed'}\n"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

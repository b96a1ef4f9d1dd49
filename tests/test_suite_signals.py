"""A SIGTERM to the test run (a CI runner stopping it) ends the run: the running test is
interrupted and no further test starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def test_sigterm_ends_the_run(tmp_path):
    marker = tmp_path / "second-test-ran"
    # a library imported at collection takes SIGTERM over and turns it into an exception
    # (what the real suite met: the running test failed and the next one started)
    (tmp_path / "test_two.py").write_text(
        "import signal, time\n"
        "def _library_handler(signum, frame):\n    raise RuntimeError('terminated')\n"
        "signal.signal(signal.SIGTERM, _library_handler)\n"
        "def test_one():\n    time.sleep(60)\n"
        f"def test_two():\n    open({str(marker)!r}, 'w').close()\n"
    )
    # the suite's conftest, as the real run loads it
    (tmp_path / "conftest.py").write_text((ROOT / "conftest.py").read_text())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_two.py")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    time.sleep(8.0)  # into test_one's sleep (collection included, on a loaded machine)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out.decode()
    assert not marker.exists(), "a test started after SIGTERM"

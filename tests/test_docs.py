"""``make docs`` builds: pdoc renders the API reference from every public module's docstrings."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_api_reference_builds(tmp_path):
    pytest.importorskip("pdoc")
    out = subprocess.run([sys.executable, "-m", "pdoc", "--docformat", "restructuredtext", "-o", str(tmp_path),
                          "shardkit", "!shardkit.bench"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "shardkit.html").exists() and (tmp_path / "shardkit" / "sources.html").exists()
    assert "Warn" not in out.stderr, out.stderr[-2000:]

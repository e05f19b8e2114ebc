"""The package's metadata: its version is the server's, and it installs without torch."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import layertap_client

REPO = Path(__file__).resolve().parents[3]
CLIENT = Path(__file__).resolve().parents[1]


def _toml_value(text: str, table: str, key: str) -> str:
    """``key = "..."`` of ``[table]`` (a minimal reader: tomllib is not in Python 3.9/3.10)."""
    section = re.search(rf"^\[{re.escape(table)}\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert section, f"no [{table}] table"
    m = re.search(rf'^{re.escape(key)}\s*=\s*"([^"]+)"', section.group(1), re.M)
    assert m, f"no {key} in [{table}]"
    return m.group(1)


def test_version_matches_the_server():
    server = _toml_value((REPO / "Cargo.toml").read_text(), "package", "version")
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", server), server
    assert layertap_client.__version__ == server
    # pyproject.toml takes its version from __version__: nothing else to keep in step.
    pyproject = (CLIENT / "pyproject.toml").read_text()
    assert re.search(r'^dynamic\s*=\s*\["version"\]', pyproject, re.M)
    assert 'version = { attr = "layertap_client.__version__" }' in pyproject
    assert not re.search(r'^version\s*=', pyproject.split("[project.optional-dependencies]")[0], re.M)
    assert metadata.version("layertap-client") == server, "reinstall the package: its metadata is stale"


def test_typed_marker_is_shipped():
    assert (Path(layertap_client.__file__).parent / "py.typed").is_file()
    files = metadata.files("layertap-client") or []
    assert any(str(f).endswith("py.typed") for f in files) or (CLIENT / "src" / "layertap_client" / "py.typed").is_file()


def test_imports_without_torch():
    # A fresh interpreter where importing torch fails: the client and the torch-free
    # dataset core still import and work; the torch datasets say what is missing.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import layertap_client, layertap_client.dataset as d\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "assert d.BulkFolder\n"
        "try:\n"
        "    d.BulkIterableDataset\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "ImportError:" in p.stdout and "torch" in p.stdout and "pip install" in p.stdout, p.stdout

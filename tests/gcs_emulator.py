"""A real GCS server for the tests: gcp-storage-emulator (the GCS JSON API) on a loopback port,
started through gcs_server.py (which adds the read headers real GCS sends).

One server per test process (pytest-xdist worker), started on first use; each test gets its own
prefix in the one bucket. Clients find it through the environment, which processes the tests
start inherit: STORAGE_EMULATOR_HOST (google-cloud-storage, gcsfs) and TENSORSTORE_GCS_HTTP_URL
(tensorstore, under Orbax).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

BUCKET = "jaxreplay-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def gcs_emulator():
    """The emulator's environment; skips where gcp-storage-emulator is not installed."""
    if importlib.util.find_spec("gcp_storage_emulator") is None:
        pytest.skip("gcp-storage-emulator is not installed (the test extra on Python >= 3.12)")
    data, port = tempfile.mkdtemp(prefix="gcs-emulator-"), _free_port()
    log = open(Path(data) / "emulator.log", "w")
    server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("gcs_server.py")), "-d", data, "start", "--host", "127.0.0.1", "--port", str(port),
                               "--default-bucket", BUCKET, "-q"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"gcp-storage-emulator did not start: {(Path(data) / 'emulator.log').read_text()}")
            time.sleep(0.1)
    url = f"http://127.0.0.1:{port}"
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "GOOGLE_CLOUD_PROJECT": "emulator"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def bucket(gcs_emulator, tmp_path, monkeypatch) -> str:
    """A fresh gs:// prefix in the emulator's bucket; bucket files are staged under tmp_path."""
    monkeypatch.setenv("JAXREPLAY_CACHE", str(tmp_path / "cache"))
    return f"gs://{BUCKET}/{uuid.uuid4().hex[:12]}"

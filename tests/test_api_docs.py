"""Offline API docs: a real headless Chromium, cut off from everything but the coordinator on 127.0.0.1,
renders Swagger UI at /docs and ReDoc at /redoc from the assets the package ships (no CDN).

Needs Chromium (Debian: ``apt-get install -y chromium``; .ci/run installs it); skipped with that reason where
no Chromium binary exists."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from coordinator_proc import Coordinator, start

pytestmark = pytest.mark.timeout(300)
CHROME = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
# network off for the browser: every host name but 127.0.0.1 fails to resolve, and anything not local goes to a
# dead proxy (port 9, discard), so a CDN request can only fail
OFFLINE = ["--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1", "--proxy-server=127.0.0.1:9",
           "--proxy-bypass-list=127.0.0.1"]
GET_BLUE = (97, 175, 254)  # Swagger UI's colour of GET operations (#61affe): present only once it rendered


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    if CHROME is None:
        pytest.skip("no Chromium binary (chromium / chromium-browser / google-chrome): apt-get install -y chromium")
    coord = start(tmp_path_factory.mktemp("docs") / "store", methods="")  # nothing to train: the API alone
    yield coord
    coord.stop()


def chromium(url: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [CHROME, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
           *OFFLINE, "--virtual-time-budget=15000", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_docs_pages_reference_only_the_coordinator(server: Coordinator) -> None:
    for page in ("/docs", "/redoc"):
        html = httpx.get(server.url + page, timeout=10).text
        assert "http://" not in html and "https://" not in html, page  # no CDN, no Google fonts
        assert "/docs/static/" in html
    for asset in ("swagger-ui/swagger-ui-bundle.js", "swagger-ui/swagger-ui.css", "redoc/redoc.standalone.js"):
        r = httpx.get(f"{server.url}/docs/static/{asset}", timeout=10)
        assert r.status_code == 200 and len(r.content) > 100_000, asset
    assert httpx.get(f"{server.url}/docs/static/../app.py", timeout=10).status_code == 404


def test_swagger_ui_renders_offline(server: Coordinator, tmp_path: Path) -> None:
    dom = chromium(server.url + "/docs", tmp_path / "dom", "--dump-dom").stdout
    assert 'id="swagger-ui"' in dom
    # rendered by the JS bundle, not in the served HTML: operation blocks of the coordinator's schema
    assert "opblock-tag" in dom and "/v1/manifest" in dom and "fl-edge coordinator" in dom, dom[:2000]
    png = tmp_path / "docs.png"
    chromium(server.url + "/docs", tmp_path / "shot", "--hide-scrollbars", "--window-size=1280,900",
             f"--screenshot={png}")
    img = np.asarray(Image.open(png).convert("RGB"), dtype=np.int16)
    assert img.shape == (900, 1280, 3) and img.std() > 10, f"blank screenshot (pixel std {img.std():.2f})"
    blue = (np.abs(img - np.array(GET_BLUE)).max(axis=-1) <= 3).mean()
    assert blue > 0.002, f"no Swagger UI GET blocks in the screenshot ({blue:.4%} of the pixels)"


def test_redoc_renders_offline(server: Coordinator, tmp_path: Path) -> None:
    dom = chromium(server.url + "/redoc", tmp_path / "dom", "--dump-dom").stdout
    assert "redoc-wrap" in dom and "/v1/manifest" in dom and "Federated test-time adaptation" in dom, dom[:2000]

"""Offline API docs: ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) from assets vendored in the package.

FastAPI's built-in pages load Swagger UI and ReDoc from a CDN (and ReDoc's fonts from Google), so they are
blank on a coordinator without internet. Here the same pages point at ``/docs/static/...``, served from
``fl_server/service/static`` (versions and licenses in its README.md). Build the app with
``docs_url=None, redoc_url=None`` and then::

    install(app)   # adds GET /docs, GET /redoc and the static mount
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).with_name("static")
STATIC_URL = "/docs/static"


def install(app: FastAPI) -> None:
    """Serve Swagger UI at ``/docs`` and ReDoc at ``/redoc`` without any external request."""
    if not (STATIC_DIR / "swagger-ui" / "swagger-ui-bundle.js").is_file():
        raise RuntimeError(f"API docs assets missing under {STATIC_DIR} (a broken install?)")
    app.mount(STATIC_URL, StaticFiles(directory=STATIC_DIR), name="apidocs-static")
    openapi_url = app.openapi_url or "/openapi.json"
    favicon = f"{STATIC_URL}/swagger-ui/favicon-32x32.png"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=openapi_url, title=f"{app.title} - API docs",
                                   swagger_js_url=f"{STATIC_URL}/swagger-ui/swagger-ui-bundle.js",
                                   swagger_css_url=f"{STATIC_URL}/swagger-ui/swagger-ui.css",
                                   swagger_favicon_url=favicon)

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=openapi_url, title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{STATIC_URL}/redoc/redoc.standalone.js",
                              redoc_favicon_url=favicon, with_google_fonts=False)

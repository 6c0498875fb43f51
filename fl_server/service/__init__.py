"""The coordinator service: FastAPI app factory, SQLite store, content-addressed artifacts, job runner."""
from fl_server.service.app import create_app
from fl_server.service.config import ServiceConfig

__all__ = ["ServiceConfig", "create_app"]

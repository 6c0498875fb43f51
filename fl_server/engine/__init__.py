"""Federated simulation engine (vectorised over clients with torch.func.vmap; per-client loop reference)."""
from fl_server.engine.simulation import RunConfig, Simulation

__all__ = ["RunConfig", "Simulation"]

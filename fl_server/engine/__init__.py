"""Federated simulation engine (vectorised over clients with torch.func.vmap; per-client loop reference)."""
from fl_server.engine.simulation import RunConfig, RunResult, Simulation, client_batches, run_local_steps

__all__ = ["RunConfig", "RunResult", "Simulation", "client_batches", "run_local_steps"]

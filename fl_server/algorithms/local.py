"""Local: every training client trains its own model on its own data; nothing is shared.
The simulated server state keeps each client's model (stacked); a new client has no model."""
from __future__ import annotations

import numpy as np
import torch

from fl_server.algorithms.base import Algorithm, LocalTrainer, NotApplicable, register
from fl_server.functional import State, broadcast, index, tree_map


@register
class Local(Algorithm):
    name = "Local"
    needs_client_data = ("nothing is aggregated (each client trains only its own model), so a federated run has no "
                         "model to export or serve; train each client on its own node instead")
    per_client_keys = ("clients",)

    def __init__(self, *args, num_train_clients: int = 1, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.num_train_clients = num_train_clients

    def init_state(self, dtype: torch.dtype, device: torch.device) -> State:
        state = super().init_state(dtype, device)
        return {**state, "clients": broadcast(state["params"], self.num_train_clients)}

    def client_start(self, server_state: State, ids: np.ndarray) -> State:
        return {"params": index(server_state["clients"], ids)}

    def aggregate(self, server_state: State, ids: np.ndarray, client_states: State, weights: torch.Tensor) -> State:
        ids_t = torch.as_tensor(ids, dtype=torch.long)

        def scatter(all_clients: torch.Tensor, updated: torch.Tensor) -> torch.Tensor:
            out = all_clients.clone()
            out[ids_t.to(out.device)] = updated
            return out

        return {**server_state, "clients": tree_map(scatter, server_state["clients"], client_states["params"])}

    def val_params(self, server_state: State, ids: np.ndarray, trainer: LocalTrainer) -> State:
        return index(server_state["clients"], ids)

    def personalize(self, server_state: State, x: torch.Tensor) -> State:
        raise NotApplicable("Local has no model for a client that never trained")

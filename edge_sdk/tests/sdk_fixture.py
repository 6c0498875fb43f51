"""Bundles with torch reference outputs, for the SDK's own tests in a venv that has no torch.

    python edge_sdk/tests/sdk_fixture.py OUT_DIR [--data-dir DIR]   # with the coordinator's environment (torch)

Writes ``OUT_DIR/fedtta_pp``, ``OUT_DIR/tent``, ``OUT_DIR/fedicon``, ``OUT_DIR/odpfl_hn``,
``OUT_DIR/odpfl_hn_dp`` and ``OUT_DIR/btfl`` (bundles of a briefly meta-trained FedTTA++, a FedAvg-initialised
TENT MLP, an initial FedICON MLP with its projection, initial ODPFL-HN encoders, plain and DP, and a briefly
trained BTFL MLP laid out as the coordinator serves it (BTFL and FedTHE run on it), on real MNIST; the embedded
digits when MNIST is absent), each signed (``manifest.sig``) with a fresh Ed25519 key whose public half is
``OUT_DIR/signing_key.pub`` (hex), and ``OUT_DIR/reference.npz``: a batch of real images and what torch
computes for it (received-model logits, personalised logits (FedICON's: ``FedICON.personalize``), FedTTA++'s chosen iterate and entropy curve,
the ODPFL-HN embeddings, the DP encoder's pooled vector and one private embedding, BTFL's features and global
logits). ``edge_sdk/tests`` checks the SDK against it. No pickle: weights and references are
plain ``.npz`` read with ``allow_pickle=False``.
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import numpy as np
import torch

from fl_server.export.btfl import export_btfl_run
from fl_server.export.bundle import export_specs, write_bundle
from fl_server.export.fedicon import fedicon_tta_step_spec
from fl_server.export.quantize import freeze_weights, quantize_int8
from fl_server.export.steps import encoder_spec, fedtta_step_spec, forward_spec, tent_step_spec
from fl_server.algorithms import build_algorithm
from fl_server.recipes.presets import FEDTTA_HP
from fl_server.data import load_dataset
from fl_server.data.errors import DataFileError
from fl_server.functional import index
from fl_server.models import build_model
from fl_server.signing import ManifestSigner

FEDTTA_PP_HP = {**FEDTTA_HP["mnist"]["FedTTA++"], "patience": 2, "max_steps": 8}


def _real_images(data_root: str | None) -> tuple[str, np.ndarray, np.ndarray]:
    try:
        ds = load_dataset("mnist", root=data_root, split="all")
    except DataFileError:
        ds = load_dataset("digits")
    return ds.name, ds.x, ds.y


def make_sdk_fixture(out: str | Path, data_root: str | None = None, n: int = 256) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    name, x_all, y_all = _real_images(data_root)
    shape = tuple(x_all.shape[1:])
    x_train, y_train = torch.from_numpy(x_all[:2048]), torch.from_numpy(y_all[:2048])
    x = torch.from_numpy(x_all[-n:])
    ref: dict[str, np.ndarray] = {"x": x.numpy(), "y": y_all[-n:]}

    fedtta = build_algorithm("FedTTA++", build_model("mlp", shape, 10, seed=0), 1, seed=0, **FEDTTA_PP_HP)
    state = fedtta.init_state(torch.float32, torch.device("cpu"))
    server = state
    for i in range(0, len(x_train), 64):  # a short meta-training run so that adaptation has something to do
        state = {k: {p: v.detach() for p, v in d.items()} for k, d in
                 fedtta.local_step(state, server, x_train[i:i + 64], y_train[i:i + 64]).items()}
    best, stopper = fedtta.personalize_early_stopping(state["params"], state["phi"], x)
    with torch.no_grad():
        ref["fedtta_pp_base_logits"] = fedtta.forward(state["params"], x).numpy()
        ref["fedtta_pp_logits"] = fedtta.forward(best, x).numpy()
    ref["fedtta_pp_best_step"] = np.array(stopper.best_step)
    ref["fedtta_pp_history"] = np.array(stopper.history)

    tent = build_algorithm("TENT", build_model("mlp", shape, 10, seed=1), 1, seed=1, steps=2)
    tstate = tent.init_state(torch.float32, torch.device("cpu"))
    tuned = tent.personalize(tstate, x)
    with torch.no_grad():
        ref["tent_logits"] = tent.forward(tuned, x).numpy()

    # FedICON's batch-mode TTA (Eq. 7): the device must draw the same views in the same order as the server
    icon = build_algorithm("FedICON", build_model("mlp", shape, 10, seed=4), 1, seed=4, tta_lr=0.05)
    istate = icon.init_state(torch.float32, torch.device("cpu"))
    ref["fedicon_logits"] = icon.forward(icon.personalize(istate, x), x).detach().numpy()

    hn = build_algorithm("ODPFL-HN", build_model("mlp", shape, 10, seed=2), 4, seed=2)
    hstate = hn.init_state(torch.float32, torch.device("cpu"))
    with torch.no_grad():
        ref["odpfl_embedding"] = hn.encode(hstate["enc"], x).numpy()
    # the DP encoder (Sec. 7): the device adds its own noise to the pooled vector (edge_sdk._dp.privatize_pooled)
    hn_dp = build_algorithm("ODPFL-HN", build_model("mlp", shape, 10, seed=3), 4, seed=3, dp=True, dp_epsilon=1.0)
    dstate = hn_dp.init_state(torch.float32, torch.device("cpu"))
    with torch.no_grad():
        ref["odpfl_dp_embedding"] = hn_dp.encode(dstate["enc"], x).numpy()
        ref["odpfl_dp_pooled"] = hn_dp.pooled(dstate["enc"], x).numpy()
        ref["odpfl_dp_private_eps1_rng5"] = hn_dp.privatize(dstate["enc"], x, rng=np.random.default_rng(5)).numpy()

    # BTFL as served (fl_server.export.btfl.export_btfl_run of the run's finalize weights, BTFL.finalize): the global model
    # and the training clients' average DLE and mean feature; a few body steps of one client stand in for training
    bt = build_algorithm("BTFL", build_model("mlp", shape, 10, seed=5), 3, seed=5, lr=0.1, body_iterations=24)
    bt_train = np.array_split(np.arange(len(x_train)), 3)
    bt.attach(x_train, y_train, bt_train)
    bt_server = bt.init_state(torch.float32, torch.device("cpu"))
    bt_client = index(bt.client_start(bt_server, np.array([0])), 0)
    for i in range(0, 24 * 64, 64):
        bt_client = bt.local_step(bt_client, bt_server, x_train[i:i + 64], y_train[i:i + 64], phase="body")
    bt_params = {k: v.detach() for k, v in bt_client["params"].items()}
    bt_state = {**bt_server, "params": bt_params}
    with torch.no_grad():
        z = bt.features(bt_params, x)
        ref["btfl_features"], ref["btfl_global_logits"] = z.numpy(), bt.global_head(bt_params, z).numpy()

    signer = ManifestSigner.generate()
    (out / "signing_key.pub").write_text(signer.public_hex + "\n")
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        graphs = export_specs({"forward": forward_spec(fedtta.model, state["params"]),
                               "fedtta_step": fedtta_step_spec(fedtta, state["params"], state["phi"])}, Path(tmp) / "f")
        frozen = freeze_weights(graphs["forward"], {p: v.numpy() for p, v in state["params"].items()},
                                Path(tmp) / "frozen.onnx")
        graphs["forward_int8"] = quantize_int8(frozen, Path(tmp) / "forward_int8.onnx")
        write_bundle(out / "fedtta_pp", graphs, {k: {p: v.numpy() for p, v in state[k].items()} for k in state},
                     "FedTTA++", FEDTTA_PP_HP, extra={"dataset": name}, signer=signer)
        graphs = export_specs({"forward": forward_spec(tent.model, tstate["params"]),
                               "tent_step": tent_step_spec(tent, tstate["params"])}, Path(tmp) / "t")
        write_bundle(out / "tent", graphs, {"params": {p: v.numpy() for p, v in tstate["params"].items()}},
                     "TENT", dataclasses.asdict(tent.hp), extra={"dataset": name}, signer=signer)
        graphs = export_specs({"forward": forward_spec(icon.model, istate["params"]),
                               "fedicon_step": fedicon_tta_step_spec(icon, istate["params"], istate["proj"])},
                              Path(tmp) / "i")
        write_bundle(out / "fedicon", graphs, {k: {p: v.numpy() for p, v in istate[k].items()}
                                               for k in ("params", "proj")},
                     "FedICON", dataclasses.asdict(icon.hp), extra={"dataset": name, "seed": 4}, signer=signer)
        graphs = export_specs({"forward": forward_spec(hn.model, hstate["params"]),
                               "encoder": encoder_spec(hn, hstate["enc"])}, Path(tmp) / "h")
        write_bundle(out / "odpfl_hn", graphs, {k: {p: v.numpy() for p, v in hstate[k].items()}
                                                for k in ("params", "enc")},
                     "ODPFL-HN", dataclasses.asdict(hn.hp), extra={"dataset": name}, signer=signer)
        graphs = export_specs({"forward": forward_spec(hn_dp.model, dstate["params"]),
                               "encoder": encoder_spec(hn_dp, dstate["enc"])}, Path(tmp) / "hdp")
        write_bundle(out / "odpfl_hn_dp", graphs, {k: {p: v.numpy() for p, v in dstate[k].items()}
                                                   for k in ("params", "enc")},
                     "ODPFL-HN", dataclasses.asdict(hn_dp.hp), extra={"dataset": name}, signer=signer)
        export_btfl_run(bt, bt_state, bt.finalize(bt_state, x_train, bt_train), out / "btfl",
                        {"dataset": name, "input_shape": list(shape), "num_classes": 10}, signer=signer)
    np.savez(out / "reference.npz", **ref)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args()
    print(f"SDK test fixture written to {make_sdk_fixture(args.out, args.data_dir)}")


if __name__ == "__main__":
    main()

"""Named experiments of the results harness: data protocol per dataset, methods with the papers'
hyperparameters, and the papers' reference numbers (SPEC.md)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from fl_server.recipes.presets import FEDICON_HP, FEDTTA_HP, upfl_hyper
from lab.data_size import FRACTIONS, run_data_size_seed
from lab.hetero import HETERO_METHODS, run_hetero_seed, run_hetero_variants
from lab.map_incomplete import run_map_seed
from lab.odpfl import DP_DELTA, run_dp_seed
from lab.shift import run_shift_seed
from lab.protocol import Experiment, Protocol
from lab.unseen import UNSEEN_METHODS, run_unseen_seed


# UPFL Table 1 (new-client "test" and training-client "val" accuracy, mean of 3 seeds).
UPFL_TABLE1_PAPER: dict[tuple[str, str, str], float] = {}
for _method, (_mv, _mt, _fv, _ft) in {
    "FedAvg": (95.06, 94.69, 90.32, 86.99), "FedProx": (96.27, 95.77, 90.35, 87.10),
    "ODPFL-HN": (96.39, 95.67, 89.24, 85.27), "TENT": (98.44, 98.51, 95.68, 94.98),
    "PFL-Ensemble": (99.02, 44.82, 97.03, 50.16), "FedTTA": (98.73, 98.47, 95.29, 93.26),
    "FedTTA-Prox": (98.76, 98.64, 95.53, 94.60), "FedTTA++": (98.94, 98.66, 96.04, 96.48),
}.items():
    UPFL_TABLE1_PAPER[("mnist", _method, "val")] = _mv
    UPFL_TABLE1_PAPER[("mnist", _method, "test")] = _mt
    UPFL_TABLE1_PAPER[("fashion_mnist", _method, "val")] = _fv
    UPFL_TABLE1_PAPER[("fashion_mnist", _method, "test")] = _ft

EXPERIMENTS: dict[str, Experiment] = {
    "upfl-table1": Experiment(
        name="upfl-table1",
        methods=("FedAvg", "TENT", "FedTTA", "FedTTA-Prox", "FedTTA++", "ODPFL-HN"),
        protocols={
            "mnist": Protocol("mnist", "mlp", rounds=200, method_hp=upfl_hyper("mnist"),
                              method_eval_every={m: 5 for m in ("FedTTA", "FedTTA-Prox", "FedTTA++", "ODPFL-HN")}),
            # FedTTA++ validates with up to 50 adaptation steps per validation client: every round, its rows did
            # not finish within a 30-minute lease of a shared H100, so the meta-learned methods validate every 5
            # rounds as on MNIST (FedAvg and TENT rows: every round)
            "fashion_mnist": Protocol("fashion_mnist", "convnet", rounds=300, method_hp=upfl_hyper("fashion_mnist"),
                                      method_eval_every={m: 5 for m in ("FedTTA", "FedTTA-Prox", "FedTTA++",
                                                                        "ODPFL-HN")},
                                      # about 75 s per round on one CPU core (the hypernetwork generates the
                                      # whole ConvNet): 300 rounds are 6 CPU-hours per seed; no GPU was lent
                                      method_rounds={"ODPFL-HN": (100, "CPU time, see the wall time")},
                                      note="eta 0.1 instead of Table 4's 0.3 (0.3 collapses; chosen on validation)"),
            # the embedded default: 1,797 8x8 digits over 20 clients (no download)
            "digits": Protocol("digits", "mlp", rounds=60, num_clients=20, method_hp=upfl_hyper("digits"),
                               note="embedded default data set; no paper number"),
        },
        paper=UPFL_TABLE1_PAPER,
        description="UPFL Table 1: train and test sets united, 100 clients, pathological 2 classes/client, "
                    "50% new clients, 85/15 train/val on training clients, tau=20, B=64, all clients per round; "
                    "test accuracy reported at the round of best validation accuracy.",
    ),
}

# BTGFL (BTFL paper Sec. 5.1) on MNIST / Fashion-MNIST; the paper's Table 2 is CIFAR-10 only (no paper numbers).
# BTFL CNN, SGD wd 5e-4, test batch 32 (paper); rounds and steps per round cut to fit a shared 2-core CPU. With
# ~1/40 of the paper's SGD steps, its lr 0.01 does not leave the one-class start: in a 4-round probe on the
# training clients' *validation* split (20 body steps/round, seed 0; not committed) lr 0.01 stayed at one-class
# accuracy for all 4 rounds, 0.05 and 0.1 left it; we use 0.05 (docs/research/btgfl-diagnosis.md has the committed probes).
_BTGFL_NOTE = ("{rounds} rounds x {iters} local steps of B=32 (5/6 body, 1/6 local head) instead of 130 rounds "
               "x (5 local + 1 personalization epochs), lr 0.05 instead of 0.01 (chosen on validation): sized to "
               "one shared CPU core; last-round model")


def _btgfl_protocol(dataset: str, rounds: int, iters: int) -> Protocol:
    return Protocol(dataset, "btfl_cnn", rounds=rounds, partition="dirichlet", num_clients=20, new_fraction=0.0,
                    val_fraction=0.1, alpha=0.1, local_iterations=iters, batch_size=32, eval_every=rounds,
                    method_hp={"BTFL": {"lr": 0.05, "weight_decay": 5e-4}},
                    note=_BTGFL_NOTE.format(rounds=rounds, iters=iters))


EXPERIMENTS["btgfl"] = Experiment(
    name="btgfl",
    methods=("FedAvg", "FedAvg+FT", "FedTHE (bs=32)", "FedTHE (bs=1)", "FedTHE-code (bs=32)", "FedTHE-code (bs=1)",
             "BTFL (bs=32)", "BTFL (bs=1)"),
    protocols={"fashion_mnist": _btgfl_protocol("fashion_mnist", 20, 48),
               "mnist": _btgfl_protocol("mnist", 20, 48),
               # the paper's budget (a GPU run): 130 rounds x (5 local + 1 personalization epochs) of the mean
               # client (mean len of build_federated(protocol, 0).train: 3,150 = 98 steps of B = 32), lr 0.01
               "fashion_mnist-paper": replace(
                   _btgfl_protocol("fashion_mnist", 130, 590), method_hp={"BTFL": {"lr": 0.01, "weight_decay": 5e-4}},
                   note="paper protocol: 130 rounds x 590 local steps of B=32 (5/6 body, 1/6 local head = 5 + 1 "
                        "epochs of the mean client), lr 0.01; last-round model")},
    paper={},
    description="BTGFL (BTFL Sec. 5.1): 20 clients Dir(0.1), BTFL CNN; per client five test streams "
                "(orig IND = held-out local data, shifted IND, orig EXD = other clients' held-out data, shifted "
                "EXD; shift = half corruptions, half rotation; synthetic = even mix), each a fresh stream. One "
                "training run serves every method (FedAvg = global head, FedAvg+FT = the client's local head on the "
                "global features; FedTHE-code = FedTHE with the authors' code's feature history, which freezes at "
                "batch size 1); accuracy = mean over clients. BTFL paper Table 2 (CIFAR-10, "
                "avg): FedAvg 58.67, FedAvg+FT 56.88, FedTHE 66.15, BTFL 68.03. fashion_mnist-paper is the "
                "paper's training budget (a GPU run, seed 0 so far): BTFL stays about 2 points below FedTHE there "
                "as at the CPU budget (docs/research/btgfl-diagnosis.md). See lab/btgfl.py.",
    runner="lab.btgfl:run_btgfl",
)


# MAP Tables I (aggregation) and II (personalization), FaMnist, T = 150, Q = 0.2, E = 5.
MAP_PAPER: dict[tuple[str, str, str], float] = {}
for _method, (_am, _al, _pm, _pl) in {
    "FedAvg": (86.2, 86.3, 90.5, 91.3), "FedProx": (86.8, 87.4, 90.7, 92.0), "FedRS": (87.8, 88.1, 90.4, 91.7),
    "FedPHP": (87.7, 87.8, 90.9, 92.1), "MAP": (88.1, 88.4, 92.1, 91.8),
    "MAP (code)": (88.1, 88.4, 92.1, 91.8),  # the paper's MAP column, which its authors' code produced
}.items():
    for _label, _agg, _pers in (("fashion_mnist", _am, _pm), ("fashion_mnist-lenet", _al, _pl)):
        for _protocol in (_label, f"{_label}-paper"):  # the CPU-budget and the paper-protocol rows alike
            MAP_PAPER[(_protocol, _method, "aggregation")] = _agg
            MAP_PAPER[(_protocol, _method, "personalization")] = _pers

# 100 clients, incomplete classes, 80/20 local train/test of the train split; E = 5 epochs of ~480 samples at
# B = 64 = 38 steps per client procedure (the engine runs the same number of steps on every client).
# CPU budget (2 shared cores, no GPU; a 38-step round took 27 s): T = 20 rounds instead of 150 (Q * T = 4
# expected selections per client) and E = 2 epochs (15 steps) instead of 5 (38 steps).
_MAP_PROTOCOL = Protocol("fashion_mnist", "mlp_2x512", rounds=20, partition="incomplete", num_clients=100,
                         new_fraction=0.0, val_fraction=0.2, local_iterations=15, batch_size=64,
                         client_fraction=0.2, eval_every=20, split="train",
                         note="CPU budget: T = 20 rounds (paper 150), E = 2 epochs = 15 steps (paper E = 5)")
_MAP_PAPER_PROTOCOL = replace(_MAP_PROTOCOL, rounds=150, local_iterations=38, eval_every=50,
                              note="paper protocol: T = 150, E = 5 epochs = 38 steps")

# FedICON's TTA rate: on the 100-round protocols validation picked the lowest of (0.0005, 0.002, 0.01) on every
# seed, on the 30-round ones once the highest; the grid now brackets both ends.
_FEDICON_TTA_LRS = (0.0001, 0.0002, 0.0005, 0.002, 0.01, 0.05)
_SHIFT_OPTIONS: dict[str, Any] = {
    "test_corruptions": ("gaussian_noise", "defocus_blur", "contrast", "elastic_transform"),
    "severities": (1, 3, 5), "val_corruptions": ("zoom_blur", "pixelate"), "domain_shift": True,
    "encoder_fraction": 0.8,
    # TENT's grid brackets its choices (0.01 or 0.05 on every seed; 0.01 was the lowest of the former (0.01, 0.05, 0.2))
    # TENT (BN affine) moves only the normalisation layers' scale and shift, whose entropy gradients are small
    # (plain SGD; the original's Adam normalises them): its grid reaches large rates (a first grid topped at 2.0,
    # which validation picked on MNIST-bn seed 0)
    "tune": {"TENT": {"tent_lr": (0.001, 0.003, 0.01, 0.05, 0.2)}, "FedICON": {"tta_lr": _FEDICON_TTA_LRS},
             "FedICON online": {"tta_lr": _FEDICON_TTA_LRS},
             "TENT (BN affine)": {"tent_lr": (0.01, 0.1, 1.0, 5.0, 20.0, 100.0)}},
    "quick": {"max_test_per_client": 40, "test_corruptions": ("gaussian_noise",), "severities": (3,),
              "val_corruptions": (), "tune": {"FedICON": {"tta_lr": (0.001, 0.01)}}},
}
_SHIFT_HP: dict[str, dict[str, Any]] = {
    "FedAvg": {"lr": 0.05, "weight_decay": 5e-4}, "FedAvg-FT": {"ft_iterations": 20}, "TENT": {"batch_size": 64},
    "TENT (BN affine)": {"batch_size": 64, "adapt": "norm_affine"},  # batch-normalised models only (-bn)
    "FedICON": FEDICON_HP,
    "FedICON online": {"tta_mode": "online", "online_chunk": 16},
}
# CPU budget: MLP 2x200 instead of the paper's CNN, the paper's 100 rounds but of 20 local steps instead of 5 epochs
# (FedICON: 80 encoder + 20 head rounds); online FedICON's test samples arrive 16 at a time, not one by one (one
# step per sample: ~50 ms per step on this CPU, ~3 h per seed). The -t30 protocols are the former budget of 30
# rounds (24 + 6), kept to show how the comparison depends on the training budget.
_SHIFT_PROTOCOL = Protocol("mnist", "mlp", rounds=100, partition="dirichlet", alpha=0.5, num_clients=20,
                           new_fraction=0.0, val_fraction=0.15, local_iterations=20, batch_size=32,
                           eval_every=100, split="train", options=_SHIFT_OPTIONS, method_hp=_SHIFT_HP,
                           note="MLP 2x200, 100 rounds x 20 steps (paper: CNN, 100 rounds x 5 epochs); CPU budget")
_SHIFT_T30_PROTOCOL = replace(_SHIFT_PROTOCOL, rounds=30, eval_every=30,
                              note="MLP 2x200, 30 rounds x 20 steps (paper: CNN, 100 rounds x 5 epochs); CPU budget")
# The paper's encoder at the CPU budget: the BTFL CNN (64-d representation, as the paper's) in place of the MLP,
# everything else as the 100-round CPU protocol (~20x the MLP's cost per step: about 15 min per training on one core)
_SHIFT_CNN_PROTOCOL = replace(_SHIFT_PROTOCOL, model="btfl_cnn",
                              note="BTFL CNN, 100 rounds x 20 steps (paper: CNN, 100 rounds x 5 epochs); CPU budget")
# The same with batch normalisation after each convolution (btfl_cnn_bn; the CNNs of FedICON's and FedBN's Digit-5
# experiments normalise): predictions of FedAvg, FedAvg-FT and FedICON w/o TTA use the training population's
# statistics, TENT's, TENT (BN affine)'s, FedICON's and FedICON BN-stats' the test batch's
# (shift.BATCH_STATS_AT_TEST)
_SHIFT_BN_PROTOCOL = replace(_SHIFT_PROTOCOL, model="btfl_cnn_bn",
                             note="BTFL CNN with batch normalisation, 100 rounds x 20 steps (paper: CNN, 100 rounds "
                                  "x 5 epochs); CPU budget")
# The paper's literal Eq. 3 (z = normalize(h(x)), no projection head: the contrastive losses, Eq. 4 and Eq. 7, act
# on the representation the classifier reads) at the 100-round CPU budget
_SHIFT_NOPROJ_PROTOCOL = replace(
    _SHIFT_PROTOCOL, method_hp={**_SHIFT_HP, "FedICON": {**_SHIFT_HP["FedICON"], "projection": "none"}},
    note="MLP 2x200, 100 rounds x 20 steps; FedICON without projection head (z = the 200-d encoder output, Eq. 3 "
         "as written); CPU budget")

# The paper's size (a GPU run): the BTFL CNN (64-d representation), 100 rounds of 5 local epochs of the mean client
# (20 Dir(0.5) clients share 85% of the train split: ~2,550 samples = 400 steps of B = 32), the paper's rates
# (FedICON's defaults: 0.005 contrastive, 0.01 CE; FedAvg 0.01), test samples streamed one at a time online.
_SHIFT_PAPER_HP: dict[str, dict[str, Any]] = {
    "FedAvg": {"lr": 0.01, "weight_decay": 5e-4}, "FedAvg-FT": {"ft_iterations": 20}, "TENT": {"batch_size": 64},
    "FedICON": {"ft_iterations": 20}, "FedICON online": {"tta_mode": "online"},
}
_SHIFT_PAPER_PROTOCOL = replace(_SHIFT_PROTOCOL, model="btfl_cnn", rounds=100, local_iterations=400, eval_every=100,
                                method_hp=_SHIFT_PAPER_HP,
                                note="paper size: BTFL CNN, 100 rounds x 400 steps (5 epochs), paper rates, online "
                                     "one sample at a time")

EXPERIMENTS["map-incomplete"] = Experiment(
    name="map-incomplete", methods=("FedAvg", "FedProx", "FedRS", "FedPHP", "MAP", "FedAvg-2stage", "MAP (code)"),
    protocols={"fashion_mnist": _MAP_PROTOCOL, "fashion_mnist-lenet": replace(_MAP_PROTOCOL, model="lenet"),
               # the same at 3x the rounds: does the gap to FedAvg depend on the truncated budget?
               "fashion_mnist-t60": replace(_MAP_PROTOCOL, rounds=60, eval_every=60,
                                            note="CPU budget: T = 60 rounds (paper 150), E = 2 epochs = 15 steps "
                                                 "(paper E = 5)"),
               # the paper's protocol (T = 150, E = 5); since the fused weight update
               # (docs/benchmarks/update-kernels.json) a seed fits on one CPU core: the MLP's and LeNet's alike
               "fashion_mnist-paper": _MAP_PAPER_PROTOCOL,
               "fashion_mnist-lenet-paper": replace(_MAP_PAPER_PROTOCOL, model="lenet")},
    paper=MAP_PAPER, run_fn=run_map_seed,
    description="MAP Tables I/II: Fashion-MNIST train split over 100 clients with 2..10 classes each, 80/20 "
                "local train/test, Q = 0.2, SGD momentum 0.9 lr 0.03 for every method; personalization "
                "= each client's personalised model after one client procedure from the final global model "
                "on its local test set (FedPHP / MAP: the HPM, Algorithm 1's client model), aggregation = "
                "global model on the test split; final round. FedPHP = FedAvg + HPM; MAP uploads after E/2 "
                "(Algorithm 1); MAP (code) runs the client procedure of the authors' released code instead "
                "(lxcnju/MAP fedap.py: E epochs of RS, uploaded, then max(0.1 E, 5) KD steps at 0.2 lr from a "
                "fresh optimiser, soft-target KD, HPM momentum capped at 0.9). The *-paper protocols are the "
                "paper's (T = 150, E = 5 = 38 steps); fashion_mnist, fashion_mnist-lenet (T = 20, E = 2) and "
                "fashion_mnist-t60 (T = 60) are CPU budgets, kept to show "
                "how FedPHP and MAP depend on the budget: with mu_k = 0.9 z_k / (Q T), a short run's HPM averages "
                "personalised models from rounds with a much weaker global model, and the upload after E/2 costs "
                "aggregation accuracy on the mean (FedAvg-2stage isolates that cost).",
)
EXPERIMENTS["fedicon-shift"] = Experiment(
    name="fedicon-shift", methods=("FedAvg", "FedAvg-FT", "TENT", "FedICON w/o TTA", "FedICON", "FedICON online"),
    protocols={"mnist": _SHIFT_PROTOCOL,
               "fashion_mnist": replace(_SHIFT_PROTOCOL, dataset="fashion_mnist",
                                        options={**_SHIFT_OPTIONS, "domain_shift": False}),
               "mnist-t30": _SHIFT_T30_PROTOCOL,
               "fashion_mnist-t30": replace(_SHIFT_T30_PROTOCOL, dataset="fashion_mnist",
                                            options={**_SHIFT_OPTIONS, "domain_shift": False}),
               "mnist-noproj": _SHIFT_NOPROJ_PROTOCOL,
               "fashion_mnist-noproj": replace(_SHIFT_NOPROJ_PROTOCOL, dataset="fashion_mnist",
                                               options={**_SHIFT_OPTIONS, "domain_shift": False}),
               "mnist-cnn": _SHIFT_CNN_PROTOCOL,
               "fashion_mnist-cnn": replace(_SHIFT_CNN_PROTOCOL, dataset="fashion_mnist",
                                            options={**_SHIFT_OPTIONS, "domain_shift": False}),
               "mnist-bn": _SHIFT_BN_PROTOCOL,
               "fashion_mnist-bn": replace(_SHIFT_BN_PROTOCOL, dataset="fashion_mnist",
                                           options={**_SHIFT_OPTIONS, "domain_shift": False}),
               "mnist-paper": _SHIFT_PAPER_PROTOCOL,
               "fashion_mnist-paper": replace(_SHIFT_PAPER_PROTOCOL, dataset="fashion_mnist",
                                              options={**_SHIFT_OPTIONS, "domain_shift": False})},
    paper={}, run_fn=run_shift_seed, optional_methods=("FedICON BN-stats", "TENT (BN affine)"),
    description="FedICON under test-time shift: 20 Dir(0.5) clients of the train split, local test sets from "
                "the test split with each client's label mix, corrupted (4 types x severities 1/3/5) or "
                "replaced by the upsampled 8x8 digits (MNIST); final-round models. FedICON = batch-mode TTA (one "
                "pass of 64-sample batches over the client's set, then prediction); FedICON online = the same "
                "trained model, the client's set streamed 16 samples at a time (each chunk: one Eq. 7 step "
                "against a memory of 64 of the client's training samples, prediction, then each sample "
                "replaces a random memory entry; the paper streams one sample at a time, too slow for this "
                "CPU; the *-paper protocols do, at the paper's size, on a GPU); the online row retrains FedICON "
                "from the same seed, which reproduces the FedICON w/o TTA rows exactly. TTA rates chosen per "
                "seed on the validation conditions (clean, zoom blur and pixelate; none of them a test "
                "condition). Reading the rows: with 100 rounds FedICON's encoder leads FedAvg and TENT under "
                "every covariate severity on both data sets and on the 8x8 digits (FedAvg-FT too, except at "
                "Fashion-MNIST's milder severities), but validation finds almost no Eq. 7 rate that helps it "
                "(accuracy falls with the rate), so the grid's lowest rates are chosen and the TTA gain is "
                "within noise of zero. With 30 rounds (-t30 rows) the weaker MNIST encoder does gain: validation "
                "picks 0.002-0.01 and the TTA rows lead the w/o-TTA rows at every severity (batch TTA gains most "
                "on the digits domain); there TENT leads FedICON on MNIST's clean and severity-3 data -- its "
                "entropy step on the whole network adapts the classifier to the client, whereas Eq. 7 tunes the "
                "encoder only -- but falls below FedAvg at severity 5. The -cnn protocols are the 100-round CPU "
                "protocol with the paper's kind of encoder (the BTFL CNN, 64-d representation) in place of the "
                "MLP. Reading their rows (3 seeds): FedICON's CNN encoder leads FedAvg and TENT at every "
                "severity on Fashion-MNIST, and at severities 1 and 3 and on the digits on MNIST, but on MNIST's "
                "contrast at severity 5 it maps nearly every image to one class on every seed (the contrast-5 "
                "rows; FedAvg's CNN keeps most of them), which pulls its MNIST severity-5 mean below FedAvg's "
                "and TENT's; the TTA gain is again within noise of zero except on Fashion-MNIST's severity 5, "
                "where Eq. 7 recovers part of the contrast-5 loss. The MLP and the -cnn CNN have no batch "
                "normalisation, so there no TTA gain can come from re-estimated normalisation statistics (the "
                "-bn protocols test that; their TENT and FedICON rows predict with the test batch's statistics, the "
                "convention of the TENT and FedICON papers, whereas a device predicts with the bundle's "
                "population statistics and uses a batch's only in its adaptation steps). The -noproj protocols "
                "run Eq. 3 "
                "as written (no projection head: Eqs. 4 and 7 act on the 200-d encoder output the classifier "
                "reads; FedAvg, FedAvg-FT and TENT rows equal the 100-round protocol's). Reading their rows (3 "
                "seeds): the TTA gain stays within noise (MNIST at most half a point at severities 3/5, "
                "Fashion-MNIST none; validation again picks the lowest rates), and without the projection the "
                "MNIST encoder is less robust at severities 3 and 5 (its w/o-TTA rows there are several points "
                "below the projection's), so the projection head is not what keeps the TTA gain away. The -bn "
                "protocols add batch normalisation after each convolution of the CNN (the kind of CNN the "
                "Digit-5 experiments of FedICON and FedBN use; fl_server/models/norm.py): FedAvg, FedAvg-FT and "
                "FedICON w/o TTA predict with the training population's statistics, TENT, FedICON and FedICON "
                "BN-stats (w/o Eq. 7 steps) with the client's test batch's. Reading their rows (3 seeds): a TTA "
                "gain appears at severity 5 on both data sets (several points) and at every severity on "
                "Fashion-MNIST (on MNIST's milder severities the test-batch statistics cost one to two tenths of a "
                "point, on the 8x8 digits about one point), but FedICON BN-stats equals FedICON to a few "
                "hundredths: all of the gain comes from the test-batch statistics, and validation again picks the "
                "lowest Eq. 7 rates. TENT, whose entropy steps use the same statistics, leads FedICON on "
                "Fashion-MNIST at every severity and on MNIST at severity 5; FedICON "
                "keeps its lead on the 8x8 digits and on MNIST at severities 1 and 3. The optional row TENT (BN "
                "affine) is the original TENT on these models (only the normalisation scale and shift move; SGD "
                "at a rate validation picks from a grid up to 100): below the whole-model TENT on both data sets, "
                "it still leads FedICON on MNIST at severity 5 and is level with it on Fashion-MNIST (ahead at "
                "every severity by less than the seed spread), so which TENT is the baseline does not change the "
                "reading. FedICON online on -bn (16 test samples per step, normalised with the chunk's "
                "statistics; 3 seeds on each data set) is within about half a point of batch-mode FedICON; "
                "validation picks the lowest Eq. 7 rate on MNIST and, on Fashion-MNIST, the second lowest on every "
                "seed, at most 0.03 points above the lowest. The fashion_mnist-paper protocol (the BTFL CNN, 100 "
                "rounds x 400 steps; seed 0 on an H200, FedICON and FedICON w/o TTA so far) reads as the CPU "
                "protocols do: "
                "validation picks the lowest Eq. 7 rate (larger ones lower its accuracy) and FedICON is within "
                "0.35 points of FedICON w/o TTA on every test condition, below it on all but two.",
)

# The ODPFL-HN paper's own protocol (odpfl-dirichlet, odpfl-dp: LeNet target, 500 steps of 10% of the clients).
# With the Table-4 rates (fl_server.recipes.presets.ODPFL_HP) the encoder gives every client nearly the same embedding (spread a few % of
# its norm) and the served model is one global model. Standardizing the
# embeddings at init (``standardize_init``) makes them differ by O(1) across clients. The standardized
# encoder's effective step on the embeddings is 1/sigma^2 (sigma ~1e-3) times its rate, so the rate must be
# small: 1e-4 diverges within 5 steps at Dir(1), 1e-5 is stable at both alphas. hn_lr from the paper's grid.
# Chosen on validation only (lab/research/probe_odpfl_hn.py, odpfl-dirichlet, seed 0, new clients removed; rows
# in docs/results/odpfl-hn-probe.json).
ODPFL_PAPER_HP: dict[str, float | bool] = {"local_lr": 0.1, "encoder_lr": 1e-5, "hn_lr": 0.05,
                                          "standardize_init": True}
# The clients' local SGD on the generated model is clipped (clip_norm 5; FedAvg, the reference, is not): without it
# a client's local step now and then blows up, the chain rule carries that into gamma's gradient (tens in most
# steps, thousands in a spike) and a few such steps in a row end the run: odpfl-dp seed 0's weights turned
# non-finite at step 24, odpfl-dirichlet-noise seed 1's hypernetwork lost every unit of its second layer within 25
# steps. Chosen on the training clients' validation at odpfl-dp seed 0 over the first 100 steps
# (lab/research/probe_odpfl_hn.py --experiment odpfl-dp --seed 0 --rounds 100 --set clip_norm=..., rows in
# docs/results/odpfl-hn-probe.json): no clip diverges; 5 / 10 / 20 reach 92.28 / 92.22 / 91.97. On
# odpfl-dirichlet-noise seed 1 (10 held-out clients, 50 steps) it turns the collapse into a run that trains
# (held-out 6.59 -> 83.07 at step 50; probe rows clip_norm=null / 5). odpfl-dp, odpfl-dirichlet-noise and
# odpfl-dirichlet run with it (odpfl-dirichlet's ODPFL-HN rows were rerun with it, every seed; its settings below
# were chosen without it, and were kept as declared before the rerun).
ODPFL_LOCAL_CLIP = {"clip_norm": 5.0}
# ODPFL-HN paper protocol (Sec. 6, CIFAR-10 there): 100 clients, Dir(alpha) labels, 10% new clients, 500 steps
# with 10% of the training clients per step. Target model: LeNet (the paper's and pFedHN's target is a LeNet-style
# CNN; the McMahan ConvNet's 1.6M-weight FC layer would need a 160M-parameter hypernetwork head).
_ODPFL_HP = {"FedAvg": {"lr": 0.1}, "ODPFL-HN": ODPFL_PAPER_HP}
_ODPFL_PROTOCOL = Protocol("fashion_mnist", "lenet", rounds=500, partition="dirichlet", num_clients=100,
                           new_fraction=0.1, client_fraction=0.1, eval_every=25, method_hp=_ODPFL_HP,
                           note="LeNet target; 500 steps x 10% of training clients; best validation step")
# Client-level validation: 10 of the 90 training clients are held out of training and scored like new clients
# to choose the step (per-sample validation on the training clients rewards a hypernetwork that memorises them;
# docs/research/odpfl-hn-diagnosis.md). Both methods use the same 80 training clients.
_ODPFL_DIRICHLET = replace(_ODPFL_PROTOCOL, options={"val_clients": 10, "quick": {"val_clients": 2}},
                           note="LeNet target; 500 steps x 10% of 80 training clients; step chosen on 10 held-out "
                                "validation clients")
# Dir(1) with noise of std 1 on the training clients' (standardized) embeddings, the best of 0 / 0.5 / 1 / 2 on the
# held-out validation clients at seed 0 (lab/research/probe_odpfl_hn.py, 500 steps: 0.5 / 1 / 2 -> 87.85 / 88.74 /
# 88.05, no noise 87.44; rows in docs/results/odpfl-hn-probe.json and the protocol's raw seed-0 row).
# Not adopted: its unclipped run's seed 1 collapsed (docs/research/odpfl-hn-diagnosis.md); the variant's runs now clip
# the clients' local steps (ODPFL_LOCAL_CLIP).
_ODPFL_NOISE_HP = {**_ODPFL_HP, "ODPFL-HN": {**ODPFL_PAPER_HP, **ODPFL_LOCAL_CLIP, "embedding_noise": 1.0}}
_ODPFL_NOISE_NOTE = "; ODPFL-HN local gradient clip 5, embedding_noise 1.0"
# Dir(1): the hypernetwork starts at the target model's own init (heads' biases = LeNet's init, heads' weights x 0.1:
# hn_head_init "target") with the noise above. Chosen on the 10 held-out validation clients at seed 0
# (lab/research/probe_odpfl_hn.py, 500 steps, hn_lr 0.05; rows in docs/results/odpfl-hn-probe.json): best held-out
# accuracy 87.44 (default init) / 88.74 (noise 1) / 89.03 (target init) / 89.30 (target init + noise 1), FedAvg's
# 88.69 on the same clients; hn_lr 0.1 with the same setting: 88.58. Target init without the noise (Dir(0.1)'s
# setting) was checked on seeds 0-2 under a rule fixed before the runs (commit 1318f66: adopt iff its mean best
# held-out accuracy exceeds this setting's, 89.30 / 88.48 / 89.49 -> 89.09): 89.03 / 88.20 / 87.94 -> 88.39, kept.
_ODPFL_TARGET_INIT = {"hn_head_init": "target", "hn_head_scale": 0.1}
_ODPFL_A1_HP = {**_ODPFL_HP, "ODPFL-HN": {**ODPFL_PAPER_HP, **_ODPFL_TARGET_INIT, **ODPFL_LOCAL_CLIP,
                                          "embedding_noise": 1.0}}
# Dir(0.1): the target-model init without the noise, chosen on the same 10 held-out validation clients at seed 0
# (lab/research/probe_odpfl_hn.py, 500 steps, hn_lr 0.05): best held-out accuracy 91.23 against 90.84 for
# ODPFL_PAPER_HP (the default init) and 87.64 with the noise added.
_ODPFL_A01_HP = {**_ODPFL_HP, "ODPFL-HN": {**ODPFL_PAPER_HP, **_ODPFL_TARGET_INIT, **ODPFL_LOCAL_CLIP}}
_ODPFL_A01_NOTE = "; ODPFL-HN hn_head_init target (scale 0.1), local gradient clip 5"
_ODPFL_A1_NOTE = _ODPFL_A01_NOTE + ", embedding_noise 1.0"
EXPERIMENTS["odpfl-dirichlet"] = Experiment(
    name="odpfl-dirichlet", methods=("FedAvg", "ODPFL-HN"),
    protocols={"fashion_mnist-a0.1": replace(_ODPFL_DIRICHLET, alpha=0.1, method_hp=_ODPFL_A01_HP,
                                             note=_ODPFL_DIRICHLET.note + _ODPFL_A01_NOTE),
               "fashion_mnist-a1": replace(_ODPFL_DIRICHLET, alpha=1.0, method_hp=_ODPFL_A1_HP,
                                           note=_ODPFL_DIRICHLET.note + _ODPFL_A1_NOTE)},
    paper={},
    description="ODPFL-HN paper protocol on Fashion-MNIST: 100 clients with Dir(alpha) labels (alpha = 0.1, 1), "
                "10 new clients, 10 validation clients (held out of training, scored like new clients to choose "
                "the step; split \"val\" below), 500 steps with 8 of the 80 training clients each; new clients "
                "get f_theta(g_gamma(D)) (FedAvg: the global model). ODPFL-HN uses the standardized encoder "
                "(ODPFL_PAPER_HP) and a hypernetwork started at the target model's own init (hn_head_init "
                "\"target\"; at Dir(1) with noise of std 1 on the training embeddings; both chosen on the "
                "validation clients), and its clients' local steps are clipped to norm 5 (ODPFL_LOCAL_CLIP, "
                "chosen on odpfl-dp's validation; these rows were rerun with it, every seed). ODPFL-HN paper "
                "Table 1 is CIFAR-10 (Dir(0.1) 66.0 vs FedAvg 58.7; Dir(1) 62.9 vs 48.4). Reading: with 10 new "
                "clients the mean moves by several points with which clients are new (per-client accuracies of "
                "the runs before the clip: docs/results/odpfl-client-breakdown.json); ODPFL-HN wins large on "
                "some clients and loses large on others. At Dir(1) the clients' label mixes are close and the "
                "hypernetwork serves nearly one model, within a tenth of a point of FedAvg's global model on the "
                "mean, well within the seed spread; with pFedHN's default "
                "init it stayed about 2 points below. At Dir(0.1) the target init raised the validation clients' "
                "mean by about 2 points over the default init and lowered the new clients' by about 1, both "
                "without the clip (docs/research/odpfl-hn-diagnosis.md). The default init "
                "with noise alone: odpfl-dirichlet-noise.",
)
EXPERIMENTS["odpfl-dirichlet-noise"] = Experiment(
    name="odpfl-dirichlet-noise", methods=("ODPFL-HN",),
    protocols={"fashion_mnist-a1": replace(_ODPFL_DIRICHLET, alpha=1.0, method_hp=_ODPFL_NOISE_HP,
                                           note=_ODPFL_DIRICHLET.note + _ODPFL_NOISE_NOTE)},
    paper={},
    description="A variant of odpfl-dirichlet Dir(1), ODPFL-HN only, with pFedHN's default hypernetwork init: "
                "noise of std 1 on the training clients' embeddings (embedding_noise), the best of 0.5 / 1 / 2 on "
                "the held-out clients at seed 0. Same clients and FedAvg as odpfl-dirichlet fashion_mnist-a1, "
                "which adds the target-model init (hn_head_init \"target\") to the same noise. The clients' local "
                "gradients are clipped to norm 5, as on odpfl-dp and odpfl-dirichlet: "
                "without the clip seed 1 collapsed to one class within 25 steps "
                "(docs/research/odpfl-hn-diagnosis.md).",
)
_ODPFL_DP_HP = {**_ODPFL_HP, "ODPFL-HN": {**_ODPFL_HP["ODPFL-HN"], **ODPFL_LOCAL_CLIP, "dp": True}}
EXPERIMENTS["odpfl-dp"] = Experiment(
    name="odpfl-dp", methods=("FedAvg", "ODPFL-HN"),
    protocols={"fashion_mnist": replace(
        _ODPFL_PROTOCOL, partition="pathological", num_clients=90, new_fraction=0.0, method_hp=_ODPFL_DP_HP,
        options={"pool": 3000, "eval_size": 300,
                 "quick": {"pool": 1000, "eval_size": 100, "set_sizes": (100, 1000), "epsilons": (1.0, float("inf"))}},
        note="LeNet target; DP encoder (unit sphere, mean pooling); local gradient clip 5; 500 steps x 10% of 90 "
             "training clients")},
    paper={}, run_fn=run_dp_seed,
    description=f"ODPFL-HN Sec. 7 on Fashion-MNIST: 10 new clients with 2 classes each and 3,000 + 300 samples; "
                f"the embedding of the first |D| samples gets Gaussian noise for (eps, delta = {DP_DELTA}) with the "
                f"client's own |D| (Lemma 2: sensitivity 2 L B / |D|); accuracy on the 300 held-out samples. 90 "
                f"pathological training clients share the rest. See lab/odpfl.py. The noise goes on the "
                f"pooled vector (sensitivity 2/|D|) before psi (edge_sdk._dp.privatize_pooled): the same guarantee as "
                f"Lemma 2's noise on e and less noise. Reading: without noise ODPFL-HN serves each new client a model "
                f"of its two classes; the noise of eps <= 1 swamps the differences between the clients' pooled "
                f"vectors except at the largest |D| (docs/research/odpfl-hn-diagnosis.md). Calibration: the "
                f"analytic Gaussian mechanism (Balle and Wang 2018), as the SDK applies it. The clients' local "
                f"gradients are clipped to norm 5 (clip_norm, chosen on the training clients' validation): without "
                f"it seed 0's weights became non-finite within the first 25 steps "
                f"(docs/research/odpfl-hn-diagnosis.md).",
)
# UPFL App. F (Table 2): 1,000 MNIST samples, 50 IID clients of 20; 25 training clients rotated by 0/30/60
# degrees, 25 new clients by 15/45. The paper reports this experiment as a bar chart only (Fig. 4).
EXPERIMENTS["upfl-concept-shift"] = Experiment(
    name="upfl-concept-shift", methods=("FedAvg", "TENT", "FedTTA", "FedTTA++"),
    protocols={"mnist": Protocol(
        "mnist", "mlp", rounds=200, partition="rotation", num_clients=50, method_hp=upfl_hyper("mnist"),
        options={"n_samples": 1000, "quick_protocol": {"num_clients": 50}},
        note="App. F layout (25 + 25 clients of 20 samples; Sec. 4.5's text says 50 + 50); training clients "
             "split 17/3 train/val; upfl-table1's MNIST hyperparameters (Table 4; FedTTA++: eta_adapt 0.01, "
             "stopping from iterate 1, chosen on Table-1 validation); no paper numbers (Fig. 4 only)")},
    paper={},
    description="UPFL concept shift (Sec. 4.5, App. F): 1,000 random MNIST samples (train and test united), 50 "
                "IID clients of 20; 25 training clients each rotated counter-clockwise by a fixed angle from "
                "{0, 30, 60}, 25 new clients by one from {15, 45}; MLP 2x200, 200 rounds, tau=20, B=64; test "
                "at the round of best validation accuracy.",
)

# UPFL Sec. 4.4 / Fig. 3 is on CIFAR-10 (not available here): Fashion-MNIST with the Table 1 protocol instead.
_FMNIST_TABLE1 = EXPERIMENTS["upfl-table1"].protocols["fashion_mnist"]
EXPERIMENTS["upfl-data-size"] = Experiment(
    name="upfl-data-size", methods=("FedAvg", "TENT", "FedTTA", "FedTTA-Prox", "FedTTA++", "ODPFL-HN"),
    protocols={"fashion_mnist": replace(
        _FMNIST_TABLE1, options={"fractions": FRACTIONS, "train_runs": "upfl-table1", "train_protocol": _FMNIST_TABLE1,
                                 # CPU smoke size (FedTTA++'s 50 adaptation steps dominate on a CPU)
                                 "quick_protocol": {"split": "test", "rounds": 3, "method_hp": {
                                     **_FMNIST_TABLE1.method_hp,
                                     "FedTTA++": {**_FMNIST_TABLE1.method_hp["FedTTA++"], "max_steps": 5}}}},
        note=_FMNIST_TABLE1.note + "; Fashion-MNIST instead of the paper's CIFAR-10; training runs shared "
             "with upfl-table1 (same protocol); no paper numbers (Fig. 3 only)")},
    paper={}, run_fn=run_data_size_seed,
    description="UPFL data size (Sec. 4.4, Fig. 3): the upfl-table1 Fashion-MNIST training, then every new "
                "client keeps a fraction a of its data (nested random subsets of round(a n) samples) to adapt "
                "on and be tested on; test at the round of best validation accuracy. Plot: "
                "docs/upfl-data-size.png.",
)

# UPFL Sec. 4.6 runs HeteroFedTTA on CIFAR-10 (lambda 0..1, eta_inner 0.5, eta_outer 0.1, eta_adapt 0.005, one
# adaptation step). Here: Fashion-MNIST with its Table 4 FedTTA++ rates and early stopping (patience 5).
# --quick: three ConvNets with second-order steps are slow on a shared 2-core CPU (a 10-step round of the
# big group took 80-125 s there; personalizing the big ConvNet on 5,000 new-client samples dominated a first
# smoke profile), so the smoke profile is 12 clients sharing 2,400 samples of the test split, 2 rounds of 3
# steps of B = 32, at most 3 adaptation steps.
_HETERO_HP = FEDTTA_HP["fashion_mnist"]["FedTTA++"]
EXPERIMENTS["upfl-hetero"] = Experiment(
    name="upfl-hetero", methods=tuple(HETERO_METHODS),
    protocols={"fashion_mnist": Protocol(
        "fashion_mnist", "convnet", rounds=300, eval_every=5, method_hp={"HeteroFedTTA": _HETERO_HP},
        options={"public_size": 1024, "public_batch": 64, "digest_epochs": 1,
                 "quick": {"public_size": 128, "public_batch": 32, "max_samples": 2400},
                 "quick_protocol": {"split": "test", "num_clients": 12, "rounds": 2, "local_iterations": 3,
                                    "batch_size": 32,
                                    "method_hp": {"HeteroFedTTA": {**_HETERO_HP, "max_steps": 3}}}},
        note="Fashion-MNIST with its FedTTA++ rates (paper: CIFAR-10, FedTTA); public set = 1,024 samples held "
             "out of the united data; psi and phi averaged within each size group; validation every 5 rounds")},
    paper={}, run_fn=run_hetero_seed, variants_fn=run_hetero_variants,
    description="UPFL HeteroFedTTA (Sec. 3.4 / 4.6, Algorithm 2): Table 1 clients (100, pathological, 50% new), "
                "each training and new client a small / medium / big ConvNet with equal probability (App. G); "
                "per round: digest (Eq. 14 KD on the public set toward the consensus logits, lambda on the base "
                "term) -> revisit (FedTTA on own data) -> logits on the public set -> consensus; a new client "
                "digests, then personalizes (FedTTA++). Rows per size group and over all clients; 'no KD' = the "
                "three groups trained independently.",
)


# New clients from domains the federation never saw (lab/unseen.py). CPU-sized UPFL
# protocol: 20 pathological clients sharing 6,000 train-split samples, all of them training clients, MLP,
# 10 rounds x 10 steps, best of the validations every 5 rounds; 10 new clients of 100 samples (2 classes) per
# condition. Sized so that 3 seeds of every method fit about half an hour per data set on a shared 2-core CPU
# (20 rounds: FedTTA's round alone took ~12 s there).
_UNSEEN_ROUNDS = 10
_UNSEEN_OPTIONS: dict[str, Any] = {
    "max_samples": 6000, "clients": 10, "per_client": 100, "severities": (3, 5),
    "test_corruptions": ("gaussian_noise", "motion_blur", "fog", "contrast"),  # noise, blur, weather, digital
    "val_corruptions": ("impulse_noise", "zoom_blur", "snow", "pixelate"),  # other types of the same families
    # issue #52: every other implemented corruption no test condition uses joins the validation pool (a rule
    # chosen on four kinds of shift generalised poorly to test kinds it never saw; with more kinds, a fixed-form
    # rule's worst validation cell bounds its harm better); drawn after the test conditions (lab/unseen.py)
    "val_corruptions_added": ("shot_noise", "defocus_blur", "glass_blur", "brightness", "elastic_transform",
                              "jpeg_compression"),
    "quick": {"max_samples": 1200, "clients": 3, "per_client": 20, "test_corruptions": ("gaussian_noise",),
              "val_corruptions": ("impulse_noise",), "val_corruptions_added": (), "severities": (5,)},
    "quick_protocol": {"num_clients": 10, "rounds": 2, "local_iterations": 5},
}


def _unseen_protocol(dataset: str) -> Protocol:
    hp = {**upfl_hyper(dataset), "FedICON": {"lr": 0.05, "head_lr": 0.5, "weight_decay": 5e-4, "tta_lr": 0.005,
                                           "encoder_rounds": int(0.8 * _UNSEEN_ROUNDS)}}
    return Protocol(dataset, "mlp", rounds=_UNSEEN_ROUNDS, num_clients=20, new_fraction=0.0, local_iterations=10,
                    split="train", method_hp=hp, options=_UNSEEN_OPTIONS, eval_every=5,
                    note="CPU protocol: MLP, 20 pathological training clients on 6,000 train-split samples, "
                         "10 rounds x 10 steps (B=64), best of the validations every 5 rounds; 10 new clients x "
                         "100 samples (2 classes) per condition")


EXPERIMENTS["unseen-domain"] = Experiment(
    name="unseen-domain", methods=tuple(UNSEEN_METHODS),
    protocols={"mnist": _unseen_protocol("mnist"), "fashion_mnist": _unseen_protocol("fashion_mnist")},
    paper={}, run_fn=run_unseen_seed,
    description="New clients from domains the federation never saw: trained on MNIST / "
                "Fashion-MNIST's train split, new clients (2 classes x 50 samples) from the test split clean, "
                "corrupted (gaussian noise, motion blur, fog, contrast at severities 3 and 5; covariate-s<k> = "
                "their mean) and, for MNIST, scikit-learn's 8x8 digits upsampled to 28x28. Measures per method: "
                "received = the model the device receives, personalised = after the method's test-time step, "
                "safeguarded = after the device's safeguard with the method's declared rule (edge_sdk.safeguard: "
                "label-free evidence from the two models on the client's unlabeled set decides to use the "
                "personalised model, roll back to the received one, or keep both partially), worse off / on = "
                "share of clients below their received model without / with it. Each rule is chosen on "
                "validation shifts only (the ten implemented corruptions no test condition uses: impulse noise, "
                "zoom blur, snow, pixelate, shot noise, defocus blur, glass blur, brightness, elastic transform, "
                "JPEG compression, at severities 3 and 5 on the training clients' validation samples; python -m "
                "lab.safeguard_choice). BTFL is not included: its new-client path "
                "is a stream with a local head fit from labels (btgfl), not a personalisation of a received model "
                "on an unlabeled set. ODPFL-HN's generated model hardly depends on the client's data at this "
                "budget, and FedICON trains poorly on this 10-round pathological protocol (its rows are far below "
                "FedAvg's).",
)


def get_experiment(name: str) -> Experiment:
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose one of {', '.join(EXPERIMENTS)}")
    return EXPERIMENTS[name]

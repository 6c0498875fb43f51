"""FedTHE's feature history (edge_sdk._fedthe.ema) in numpy alone: exact against the plain recurrence and, where
scipy is importable, against scipy.signal.lfilter (what it replaced); FedTHE runs with scipy unimportable."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from edge_sdk._fedthe import code_history, ema, feature_history, fedthe_predict

DECAYS = [0.0, 1e-12, 1e-3, 0.1, 0.9, 0.999, 0.999999, 1.0]


def recurrence(x: np.ndarray, decay: float, initial: np.ndarray) -> np.ndarray:
    """The definition, one sample at a time: h_t = decay h_{t-1} + (1 - decay) x_t from h_0 = initial."""
    out, h = np.empty_like(x), initial.astype(np.float64)
    for t, row in enumerate(x):
        h = decay * h + (1.0 - decay) * row
        out[t] = h
    return out


def close(ours: np.ndarray, ref: np.ndarray) -> None:
    """Equal to 1e-12 relative to the stream's scale (an element near 0 has no meaningful relative error)."""
    np.testing.assert_allclose(ours, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())


@pytest.fixture(scope="module")
def long_stream() -> np.ndarray:
    """10^5 samples, 3 features, mean away from 0 (a history that drifts) plus a step half way."""
    x = np.random.default_rng(46).normal(0.5, 1.0, (100_000, 3))
    x[50_000:] += 4.0
    return x


@pytest.mark.parametrize("decay", DECAYS)
def test_ema_is_the_recurrence_on_a_long_stream(long_stream: np.ndarray, decay: float) -> None:
    initial = np.array([-3.0, 0.0, 10.0])
    close(ema(long_stream, decay, initial), recurrence(long_stream, decay, initial))


@pytest.mark.parametrize("decay", DECAYS)
def test_ema_is_scipy_lfilter(long_stream: np.ndarray, decay: float) -> None:
    signal = pytest.importorskip("scipy.signal", reason="the lfilter comparison needs scipy (the SDK does not)")
    x = long_stream[:20_000]
    initial = x[0]
    ref = signal.lfilter([1.0 - decay], [1.0, -decay], x, axis=0, zi=decay * initial[None])[0]
    close(ema(x, decay, initial), ref)
    close(feature_history(x, decay), ref)  # a new stream starts its history at its first feature


@pytest.mark.parametrize("n", [1, 2, 1023, 1024, 1025, 3001])
def test_ema_block_edges(n: int) -> None:
    """Stream lengths around the block length (1024 rows at most) and a decay whose block is 2 rows long."""
    x = np.random.default_rng(n).normal(size=(n, 2))
    for decay in (0.5, 1e-200):
        close(ema(x, decay, np.ones(2)), recurrence(x, decay, np.ones(2)))


def test_feature_history_continues_a_stream_from_its_initial_history() -> None:
    """Cut anywhere, the second part started from the first part's last history gives the whole stream's."""
    z = np.random.default_rng(1).exponential(1.0, (700, 16))
    whole = feature_history(z)
    for cut in (1, 37, 699):
        first = feature_history(z[:cut])
        close(feature_history(z[cut:], initial=first[-1]), whole[cut:])
    h0 = np.linspace(-1.0, 1.0, 16)
    close(feature_history(z, 0.9, initial=h0), recurrence(z, 0.9, h0))
    assert not np.allclose(feature_history(z[37:]), whole[37:])  # without it, a new stream starts over


def test_ema_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"need x \[N, D\] and initial \[D\]"):
        ema(np.ones((4, 3)), 0.9, np.ones(2))
    with pytest.raises(ValueError, match="decay must be finite"):
        ema(np.ones((4, 3)), float("nan"), np.ones(3))
    with pytest.raises(ValueError, match="non-empty"):
        feature_history(np.ones((0, 3)))


def test_fedthe_runs_without_scipy(tmp_path: Path) -> None:
    """Both variants of fedthe_predict and both histories with any import of scipy failing: the same numbers."""
    rng = np.random.default_rng(7)
    g, l_, z = rng.normal(0, 2, (50, 10)), rng.normal(0, 2, (50, 10)), rng.exponential(1.0, (50, 8))
    mu_l, mu_g = rng.exponential(1.0, 8), rng.exponential(1.0, 8)
    arrays = {"g": g, "l": l_, "z": z, "mu_l": mu_l, "mu_g": mu_g}
    code = ("import sys; sys.modules['scipy'] = None\n"  # any import of scipy now fails
            "import numpy as np\n"
            "from edge_sdk._fedthe import code_history, feature_history, fedthe_predict\n"
            "a = np.load(sys.argv[1])\n"
            "out = [fedthe_predict(a['g'], a['l'], a['z'], a['mu_l'], a['mu_g'], 16, variant=v)[0]\n"
            "       for v in ('spec', 'code')]\n"
            "out += [feature_history(a['z'], initial=a['mu_l']), code_history(a['z'], 16)]\n"
            "np.save(sys.argv[2], np.concatenate([o.ravel() for o in out]))\n")
    np.savez(tmp_path / "in.npz", **arrays)
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "in.npz"), str(tmp_path / "out.npy")],
                   check=True, capture_output=True, text=True)
    got = np.load(tmp_path / "out.npy")
    want = [fedthe_predict(g, l_, z, mu_l, mu_g, 16, variant=v)[0] for v in ("spec", "code")]
    want += [feature_history(z, initial=mu_l), code_history(z, 16)]
    np.testing.assert_array_equal(got, np.concatenate([w.ravel() for w in want]))

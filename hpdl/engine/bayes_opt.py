"""Bayesian optimisation of a noisy score over a box: a Gaussian process and expected improvement.

The autotuner (autotune.py) uses it to choose the next engine parameters to try from the
scores of those tried so far, as Horovod's ``optim/bayesian_optimization.cc`` does: a Gaussian
process with a squared-exponential kernel and the noise level ``alpha`` on its diagonal (the
scores of a training job are noisy), fitted by maximum likelihood; the next point maximises
the expected improvement over the best predicted score, with the exploration margin ``xi``.
Scores are standardised once three are known. Only numpy: a handful of points in two
dimensions needs no optimiser library; the kernel's two hyperparameters are fitted over a
grid, and the acquisition is maximised over random points, then refined around the best.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

# Kernel hyperparameters tried when fitting, on inputs scaled to [0, 1]: length scales from a
# tenth of the box to twice it, signal deviations around the standardised scores' 1.
_LENGTHS = np.geomspace(0.05, 2.0, 16)
_SIGMAS = np.geomspace(0.25, 4.0, 9)


def _sqdist(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.maximum(0.0, (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T)


class GaussianProcess:
    """A zero-mean Gaussian process with an isotropic squared-exponential kernel."""

    def __init__(self, alpha: float):
        self.alpha = alpha  # the observations' noise deviation
        self.length = 1.0
        self.sigma_f = 1.0
        self._x = np.zeros((0, 0))
        self._weights = np.zeros(0)
        self._chol = np.zeros((0, 0))

    def _kernel(self, a: np.ndarray, b: np.ndarray, length: float, sigma_f: float) -> np.ndarray:
        return sigma_f * sigma_f * np.exp(-0.5 * _sqdist(a, b) / (length * length))

    def _factor(self, x: np.ndarray, length: float, sigma_f: float) -> np.ndarray:
        k = self._kernel(x, x, length, sigma_f)
        k[np.diag_indices_from(k)] += self.alpha * self.alpha + 1e-10
        return np.linalg.cholesky(k)

    def fit(self, x: np.ndarray, y: np.ndarray) -> None:
        """Choose the kernel's length scale and deviation that make ``y`` most likely, and keep
        what prediction needs."""
        best: Optional[Tuple[float, float, float]] = None
        for length in _LENGTHS:
            for sigma_f in _SIGMAS:
                try:
                    chol = self._factor(x, length, sigma_f)
                except np.linalg.LinAlgError:
                    continue
                weights = np.linalg.solve(chol.T, np.linalg.solve(chol, y))
                nll = 0.5 * float(y @ weights) + float(np.log(np.diag(chol)).sum())
                if best is None or nll < best[0]:
                    best = (nll, float(length), float(sigma_f))
        if best is not None:
            self.length, self.sigma_f = best[1], best[2]
        self._x = x
        self._chol = self._factor(x, self.length, self.sigma_f)
        self._weights = np.linalg.solve(self._chol.T, np.linalg.solve(self._chol, y))

    def predict(self, x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """The posterior mean and standard deviation at each row of ``x``."""
        k_s = self._kernel(self._x, x, self.length, self.sigma_f)
        mean = k_s.T @ self._weights
        v = np.linalg.solve(self._chol, k_s)
        var = self.sigma_f * self.sigma_f - (v * v).sum(0)
        return mean, np.sqrt(np.maximum(var, 0.0))


def expected_improvement(mean: np.ndarray, std: np.ndarray, best: float, xi: float) -> np.ndarray:
    """How much each point is expected to improve on ``best`` (0 where the model is certain)."""
    imp = mean - best - xi
    out = np.zeros_like(mean)
    ok = std > 0
    z = imp[ok] / std[ok]
    cdf = 0.5 * np.array([math.erfc(-v / math.sqrt(2.0)) for v in z])
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    out[ok] = imp[ok] * cdf + std[ok] * pdf
    return out


class BayesianOptimization:
    """Proposes where to sample next in ``bounds`` from the samples so far (higher is better)."""

    def __init__(self, bounds: Sequence[Tuple[float, float]], alpha: float, xi: float = 0.01, seed: int = 0,
                 candidates: int = 2000):
        self.low = np.array([b[0] for b in bounds], dtype=float)
        self.high = np.array([b[1] for b in bounds], dtype=float)
        self.xi = xi
        self.candidates = candidates
        self.gp = GaussianProcess(alpha)
        self._rng = np.random.default_rng(seed)
        self.xs: List[np.ndarray] = []
        self.ys: List[float] = []

    def add_sample(self, x: Sequence[float], y: float) -> None:
        self.xs.append(np.asarray(x, dtype=float))
        self.ys.append(float(y))

    def clear(self) -> None:
        self.xs, self.ys = [], []

    def _unit(self, x: np.ndarray) -> np.ndarray:
        span = np.where(self.high > self.low, self.high - self.low, 1.0)
        return (x - self.low) / span

    def _scaled(self, u: np.ndarray) -> np.ndarray:
        return self.low + u * (self.high - self.low)

    def next_sample(self) -> np.ndarray:
        """The point of the box with the greatest expected improvement."""
        d = len(self.low)
        if not self.xs:
            return self._scaled(self._rng.random(d))
        y = np.array(self.ys)
        if len(y) >= 3:  # standardised, as Horovod does from three samples on
            std = y.std()
            y = (y - y.mean()) / (std if std > 0 else 1.0)
        x = self._unit(np.array(self.xs))
        self.gp.fit(x, y)
        best = float(self.gp.predict(x)[0].max())  # the noisy model's best, not the best noisy score
        u = self._rng.random((self.candidates, d))
        ei = expected_improvement(*self.gp.predict(u), best, self.xi)
        top = u[int(np.argmax(ei))]
        # Refine around the best candidate: a few rounds of ever smaller random steps.
        top_ei = float(ei.max())
        for radius in (0.05, 0.02, 0.005):
            near = np.clip(top + radius * self._rng.standard_normal((64, d)), 0.0, 1.0)
            ei_near = expected_improvement(*self.gp.predict(near), best, self.xi)
            i = int(np.argmax(ei_near))
            if ei_near[i] > top_ei:
                top, top_ei = near[i], float(ei_near[i])
        return self._scaled(top)

"""Lloyd-Max scalar codebooks for the coordinates of a randomly rotated unit vector.

Owns: the optimal 1..4-bit scalar quantizer (centroids and decision boundaries) for N(0, 1)
and for the exact density of one coordinate of a uniformly random unit vector in R^d,
computed by Lloyd's iteration to a fixed point and cached. Must never touch torch, devices
or how codes are stored.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import numpy as np

MAX_BITS = 4
TOLERANCE = 1e-10
MAX_ITERATIONS = 100_000

Curve = Callable[[np.ndarray], np.ndarray]


class Codebook(NamedTuple):
    centroids: tuple[float, ...]  # 2**bits values, ascending, symmetric about 0
    boundaries: tuple[float, ...]  # 2**bits - 1 decision thresholds: midpoints of centroids


@functools.lru_cache(maxsize=None)
def gaussian_codebook(bits: int) -> Codebook:
    """Lloyd-Max codebook for N(0, 1); divide by sqrt(d) for a coordinate in dimension d."""
    _check_bits(bits)
    levels = 2**bits
    start = np.linspace(-2.0, 2.0, levels) if levels > 2 else np.array([-1.0, 1.0])
    return _lloyd_max(_gaussian_cdf, _gaussian_partial_mean, start, support=math.inf)


@functools.lru_cache(maxsize=None)
def sphere_codebook(dim: int, bits: int) -> Codebook:
    """Lloyd-Max codebook for one coordinate of a uniform random unit vector in R^dim.

    That coordinate has density proportional to (1 - t^2)^((dim - 3) / 2) on [-1, 1] (a
    symmetric Beta); as dim grows it tends to N(0, 1/dim), so the codebook tends to
    gaussian_codebook(bits) / sqrt(dim); the iteration starts there, squashed by tanh into
    (-1, 1) so that small dims start from distinct points inside the support.
    """
    _check_bits(bits)
    if not isinstance(dim, int) or dim < 2:
        raise ValueError(f"dim must be an integer >= 2, got {dim!r}")
    start = np.tanh(np.array(gaussian_codebook(bits).centroids) / math.sqrt(dim))
    cdf, partial_mean = _sphere_curves(dim)
    return _lloyd_max(cdf, partial_mean, start, support=1.0)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"codebook bits must be an integer in 1..{MAX_BITS}, got {bits!r}")


def _lloyd_max(cdf: Curve, partial_mean: Curve, centroids: np.ndarray, support: float) -> Codebook:
    """Alternate boundaries = midpoints and centroids = cell means until centroids stop moving.

    partial_mean(t) is the integral of s * density(s) from the left end of the support to t,
    so a cell's conditional mean is a difference of two closed-form values.
    """
    for _ in range(MAX_ITERATIONS):
        edges = np.concatenate(([-support], (centroids[1:] + centroids[:-1]) / 2, [support]))
        updated = np.diff(partial_mean(edges)) / np.diff(cdf(edges))
        converged = np.max(np.abs(updated - centroids)) < TOLERANCE
        centroids = updated
        if converged:
            return Codebook(tuple(centroids.tolist()),
                            tuple(((centroids[1:] + centroids[:-1]) / 2).tolist()))
    raise RuntimeError(f"Lloyd-Max did not converge in {MAX_ITERATIONS} iterations")


def _gaussian_cdf(t: np.ndarray) -> np.ndarray:
    return np.array([0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) for v in t])


def _gaussian_partial_mean(t: np.ndarray) -> np.ndarray:
    return -np.exp(-np.square(t) / 2) / math.sqrt(2 * math.pi)


def _sphere_curves(dim: int) -> tuple[Curve, Curve]:
    """CDF and partial mean of the coordinate density, in closed form.

    With t = sin(theta) the density of theta is cos(theta)^(dim-2) on (-pi/2, pi/2), whose
    integral from 0 follows the exact reduction I_k = cos^(k-1) sin / k + (k-1)/k * I_(k-2);
    every term has the sign of theta, so the recursion never cancels.
    """
    power = dim - 2

    def integral(t: np.ndarray) -> np.ndarray:
        cos = np.sqrt(np.clip(1.0 - t * t, 0.0, None))
        value = t.copy() if power % 2 else np.arcsin(t)
        for k in range(2 + power % 2, power + 1, 2):
            value = cos ** (k - 1) * t / k + (k - 1) / k * value
        return value

    total = 2.0 * integral(np.array([1.0]))[0]

    def cdf(t: np.ndarray) -> np.ndarray:
        return 0.5 + integral(np.clip(t, -1.0, 1.0)) / total

    def partial_mean(t: np.ndarray) -> np.ndarray:
        one_minus_t2 = np.clip(1.0 - t * t, 0.0, None)
        return -one_minus_t2 ** ((dim - 1) / 2) / ((dim - 1) * total)

    return cdf, partial_mean

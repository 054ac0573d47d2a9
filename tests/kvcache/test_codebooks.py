"""Lloyd-Max codebooks against the spec's table, closed forms and direct numerical integration."""
import math

import numpy as np
import pytest

from slipstream.kvcache.codebooks import gaussian_codebook, sphere_codebook

# Positive halves of the N(0, 1) Lloyd-Max centroids, from docs/turboquant.md.
SPEC_CENTROIDS = {
    1: [0.797885],
    2: [0.452780, 1.510418],
    3: [0.245094, 0.756005, 1.343909, 2.151946],
    4: [0.128395, 0.388048, 0.656759, 0.942340, 1.256231, 1.618046, 2.069017, 2.732590],
}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_gaussian_centroids_match_spec_table(bits):
    book = gaussian_codebook(bits)
    expected = np.array(SPEC_CENTROIDS[bits])
    np.testing.assert_allclose(book.centroids[2 ** (bits - 1):], expected, atol=1e-4)
    np.testing.assert_allclose(book.centroids[:2 ** (bits - 1)], -expected[::-1], atol=1e-4)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_boundaries_are_midpoints(bits):
    c = np.array(sphere_codebook(64, bits).centroids)
    np.testing.assert_allclose(sphere_codebook(64, bits).boundaries, (c[1:] + c[:-1]) / 2)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_sphere_codebook_in_dimension_3_is_the_uniform_quantizer(bits):
    # A coordinate of a uniform unit vector in R^3 is uniform on [-1, 1] (Archimedes).
    levels = 2**bits
    expected = (2 * np.arange(levels) + 1) / levels - 1
    np.testing.assert_allclose(sphere_codebook(3, bits).centroids, expected, atol=1e-8)


@pytest.mark.parametrize("dim", [2, 16, 64, 128])
def test_sphere_one_bit_centroid_is_mean_absolute_coordinate(dim):
    mean_abs = math.exp(math.lgamma(dim / 2) - math.lgamma((dim + 1) / 2)) / math.sqrt(math.pi)
    assert sphere_codebook(dim, 1).centroids[1] == pytest.approx(mean_abs, abs=1e-9)


@pytest.mark.parametrize("dim,bits", [(16, 4), (48, 3), (128, 2)])
def test_sphere_centroids_are_cell_means_of_the_beta_density(dim, bits):
    """Fixed point check by brute-force integration, independent of the closed forms."""
    book = sphere_codebook(dim, bits)
    t = np.linspace(-1, 1, 2_000_001)
    density = (1 - t * t) ** ((dim - 3) / 2)
    edges = [-1.0, *book.boundaries, 1.0]
    for centroid, lo, hi in zip(book.centroids, edges[:-1], edges[1:]):
        cell = (t >= lo) & (t < hi)
        mean = np.sum(t[cell] * density[cell]) / np.sum(density[cell])
        assert centroid == pytest.approx(mean, abs=2e-6)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_sphere_codebook_tends_to_scaled_gaussian(bits):
    gaussian = np.array(gaussian_codebook(bits).centroids)
    gap = {d: np.max(np.abs(np.array(sphere_codebook(d, bits).centroids) * math.sqrt(d) - gaussian))
           for d in (64, 1024)}
    assert gap[1024] < gap[64] / 8  # the Beta density approaches N(0, 1/d) like 1/d
    assert gap[1024] < 1e-2


def test_codebooks_are_cached():
    assert sphere_codebook(64, 3) is sphere_codebook(64, 3)
    assert gaussian_codebook(2) is gaussian_codebook(2)


@pytest.mark.parametrize("bits", [0, 5, 2.5, "3"])
def test_bad_bits_are_rejected_with_the_value(bits):
    with pytest.raises(ValueError, match=repr(bits).replace(".", r"\.")):
        gaussian_codebook(bits)


@pytest.mark.parametrize("dim", [1, 0, 2.0])
def test_bad_dim_is_rejected_with_the_value(dim):
    with pytest.raises(ValueError, match=repr(dim).replace(".", r"\.")):
        sphere_codebook(dim, 2)

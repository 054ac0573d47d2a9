"""Paged storage of TurboQuant codes: per layer, one uint8 row per (token, KV head) for K and V.

Shape per layer: [num_blocks, block_size, num_kv_heads, nbytes]. Writing quantizes the
step's new K/V (keys after rotary, as they are stored), on the CPU with the native encoder
(kernels/turboquant_encode.c) where it is built, else with `TurboQuantizer.quantize`, the
reference it is tested against; `codes_by_head` hands attention the
codes through block tables. `gather`/`gather_batch` dequantize and exist for the reference
path (dequantize-then-attend) that tests compare the code-reading attention against.

Keys are stored as (k - mu) / sigma, with mu and sigma fixed per KV head and channel:
- mu, the mean key: <q, k_t> = <q, k_t - mu> + <q, mu>, and the last term is the same for
  every key of a query, which softmax ignores; the bits go to what varies between keys.
- sigma = (E[(k - mu)_j^2] / E[q_j^2])^(1/4): scores use q * sigma, so <q, k> is unchanged,
  but the rotation then spreads the quantization error over channels in proportion to how
  much queries read them. This minimises E(q-weighted error) * E|k / sigma|^2 over diagonal
  scalings (Cauchy-Schwarz); SmolLM2's keys have channels 4-13x the median RMS.
Rotary embeddings turn each channel pair (i, i + D/2) of the stored keys with position, at the
pair's frequency; SmolLM2 keeps most of its key energy (|mu| / |k| 0.5-0.8) as a near-constant
vector in a few slow pairs. A mean measured on the calibration prompt's first 1k positions is
wrong wherever such a pair turns further by the last position served: at 8k, k - mu there grew
larger than k itself and every code's error with it (tq4 at 8k tokens: +1.8% perplexity; +0.6%
with the rule below). So, given `key_turns` (radians each pair turns over the positions served),
mu is kept only on pairs that turn less than STEADY_TURN, and sigma and the query power are
tied within each pair, so neither depends on the phase the calibration happened to see.
Values are stored as v / s, s = (E[v_j^2] / w_j)^(1/4) per KV head and channel, where w_j (`value_weights`) is
the energy of channel j's column of the output projection over the query heads that read it: the same balance for
the error that the projection, not a query, meets (attention's sum is linear, so s comes back in `decode_maps`;
the 16-bit window is read unscaled). SmolLM2's columns differ 10x in energy. tq3 at 8k (kv_defaults.py, code /
dialogue perplexity): +1.95% / +2.06% unscaled, +1.72% / +1.87% with w = 1, +1.52% / +1.67% weighted (KL 0.0191 /
0.0172, 0.0188 / 0.0156, 0.0188 / 0.0155). Values at 2.5 / 3.5 bits keep s = 1: their outlier split already gives the
high-power channels more bits, and the scale on top measured no better (tq2.5 at 8k, perplexity: +2.43 / +3.17 /
+2.71% without, +2.93 / +3.26 / +2.68% with).
Both scales also carry a factor per KV head that puts the median stored norm at 1, the middle of the range of
the 1-byte norms that codes of at most 2 bits keep (TurboQuantizer, NORM8; Gemma 3's norms reach 1,000,
SmolLM2's 0.06), so that range holds for any model.
All of these are measured once, with the outlier channels of 2.5/3.5 bits, then never change, so
every stored block, and the prefix cache, stays valid; no per-token scale is stored. The
engine runs a calibration prompt first: until `finish_calibration`, attention `observe`s its
q/k/v and attends to them exactly, and nothing is written to the blocks.
Keys and values store the norm-corrected scale |x|^2 / <x, x_hat_unit> (see TurboQuantizer); values are not
centred. tq3 at 4k, KL 0.0097; values without the correction 0.0267, centred on their mean 0.0213 (likely
because heads that park their attention on tokens with small values need those values' errors small).

With `recent_tokens` or `sink_tokens` > 0, a `RecentWindow` also keeps the newest and the
first tokens of each sequence in 16 bits; attention reads them from there, not the codes.
"""
from __future__ import annotations

import functools
import math

import torch

from slipstream.backends.cpu import abi
from slipstream.kvcache.recent_window import RecentWindow, Staging
from slipstream.kvcache.turboquant import TurboQuantizer

# radians: a rotary pair that turns less over the positions served keeps its mean (0.5 / 1 / 2 measured
# on SmolLM2 at 8k, tq4 KL 0.0087 / 0.0085 / 0.0091)
STEADY_TURN = 1.0


class TurboQuantLayerCache:
    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 bits: float, key_mode: str, seed: int, device: torch.device, recent_tokens: int = 0,
                 num_staging: int = 0, dense_dtype: torch.dtype = torch.bfloat16, sink_tokens: int = 0,
                 value_bits: float | None = None, key_turns: torch.Tensor | None = None,
                 staging: Staging | None = None, value_weights: torch.Tensor | None = None):
        """bits: the keys' (and, with value_bits None, the values') bits per coordinate; key_turns: radians
        each rotary pair of the keys turns over the positions served (None: keys do not turn); staging: the
        16-bit window's placement shared with the model's other layers (None: one of its own); value_weights:
        [Hk, D], how much each value channel counts after the output projection (None: all alike)."""
        self.block_size = block_size
        self.key_turns = key_turns
        self.value_weights = value_weights
        if staging is None and (recent_tokens or sink_tokens):
            staging = Staging(recent_tokens, sink_tokens, num_blocks, num_staging, block_size, device)
        self.window = None if staging is None else RecentWindow(staging, num_kv_heads, head_dim, dense_dtype, device)
        self.key_quantizer = _quantizer(head_dim, bits, key_mode, seed=2 * seed)
        self.value_quantizer = _quantizer(head_dim, value_bits or bits, "mse", seed=2 * seed + 1)
        self.k = _rows((num_blocks, block_size, num_kv_heads, self.key_quantizer.nbytes), device)
        self.v = _rows((num_blocks, block_size, num_kv_heads, self.value_quantizer.nbytes), device)
        self.key_mean = torch.zeros(num_kv_heads, head_dim, device=device)
        self.key_scale = torch.ones(num_kv_heads, head_dim, device=device)
        self.value_scale = torch.ones(num_kv_heads, head_dim, device=device)
        self.calibrated = False
        self.encoder = None  # encoder(rows, quantizer, x, slots, mean=None, scale=None), bound by a backend
        self._seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, bits: float, key_mode: str,
                        value_bits: float | None = None) -> int:
        k = TurboQuantizer(head_dim, bits, mode=key_mode).nbytes
        v = TurboQuantizer(head_dim, value_bits or bits, mode="mse").nbytes
        return num_kv_heads * (k + v)

    def observe(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Before calibration: keep one step of the calibration sequence; returns all its K/V so far [Hk, L, D]."""
        self._seen.append((_query_power(q.float(), k.shape[1]) * len(q), k.float(), v.float()))
        return (torch.cat([k for _, k, _ in self._seen]).transpose(0, 1),
                torch.cat([v for _, _, v in self._seen]).transpose(0, 1))

    def finish_calibration(self) -> None:
        """Fix mu, sigma and the outlier channels from every step that `observe` kept."""
        k = torch.cat([k for _, k, _ in self._seen])
        self._fix(sum(power for power, _, _ in self._seen) / len(k), k, torch.cat([v for _, _, v in self._seen]))
        self._seen.clear()

    def calibrate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fix mu, sigma and the outlier channels from q [T, Hq, D], k/v [T, Hk, D]."""
        self._fix(_query_power(q.float(), k.shape[1]), k.float(), v.float())

    def _fix(self, query_power: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.calibrated:
            raise RuntimeError("the TurboQuant cache is already calibrated; stored codes depend on it")
        self.key_mean = k.mean(0)
        if self.key_turns is not None:
            self.key_mean = self.key_mean * _pairs(self.key_turns.to(k.device) < STEADY_TURN)
        key_power = (k - self.key_mean).square().mean(0)
        if self.key_turns is not None:
            key_power, query_power = _pair_mean(key_power), _pair_mean(query_power)
        self.key_scale = _balanced(key_power, query_power)
        self.key_scale = self.key_scale * _median_norm(self.scaled_keys(k))
        self.key_quantizer.calibrate(self.scaled_keys(k))
        if self.value_quantizer.bits % 1 == 0:  # an outlier split already spends its bits by channel power
            weights = torch.ones_like(v[0]) if self.value_weights is None else self.value_weights.to(v.device)
            self.value_scale = _balanced(v.square().mean(0), weights)
        self.value_scale = self.value_scale * _median_norm(self.scaled_values(v))
        self.value_quantizer.calibrate(self.scaled_values(v))
        self.calibrated = True

    @functools.cached_property
    def decode_maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per KV head, [Hk, D, key code width] taking a query to key code space (sigma folded in) and
        [Hk, D, D] taking a value code-space sum back to channels: each a single matmul."""
        if not self.calibrated:
            raise RuntimeError("decode_maps depend on the calibration; calibrate first")
        heads, dim = self.key_scale.shape
        eye = torch.eye(dim, device=self.key_scale.device).expand(heads, dim, dim)
        return (self.key_quantizer.rotate_queries(eye * self.key_scale[:, None, :]).contiguous(),
                (self.value_quantizer.restore(eye) * self.value_scale[:, None, :]).contiguous())

    @functools.cached_property
    def embed_maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per KV head, [Hk, D, key code width] and [Hk, D, value code width] taking a 16-bit key (less the
        mean) and value into code space: the inverses of `decode_maps`, so that a query's score and a
        weighted sum come out the same whether a token is read in code space or in channels."""
        to_keys, back = (m.double() for m in self.decode_maps)
        return (torch.linalg.pinv(to_keys).transpose(-1, -2).float().contiguous(),
                torch.linalg.pinv(back).float().contiguous())

    def code_space(self, block_table: torch.Tensor, length: int,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` tokens through a block table as code-space key and value rows [Hk, length, W]:
        the torch twin of backends/cpu's native expansion."""
        keys, values = self.codes_by_head(block_table)
        return (self.key_quantizer.code_space(keys[:, :length]).to(dtype),
                self.value_quantizer.code_space(values[:, :length]).to(dtype))

    def scaled_keys(self, k: torch.Tensor) -> torch.Tensor:
        """What is quantized: (k - mu) / sigma, for k [..., Hk, D]."""
        return (k.float() - self.key_mean) / self.key_scale

    def scaled_values(self, v: torch.Tensor) -> torch.Tensor:
        """What is quantized: v / s, for v [..., Hk, D]."""
        return v.float() / self.value_scale

    def value_sum(self, p: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """sum_t p_t v_t in channels: p [..., Hk, M, T], value codes [..., Hk, T, nbytes] -> [..., Hk, M, D]."""
        return self.value_quantizer.weighted_sum(p, codes) * self.value_scale[:, None, :]

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The step's K/V [T, Hk, D] as codes at slot_mapping, and into the 16-bit window the tokens that the
        step's staging plan mirrors before attention (`Staging.writes`; none outside a step's attention)."""
        if not self.calibrated:
            raise RuntimeError("TurboQuantLayerCache.calibrate must run before the first write")
        if self.encoder is not None:  # a backend's encoder (backends/cuda: Triton), tested against quantize
            self.encoder(self.k, self.key_quantizer, k, slot_mapping, self.key_mean, self.key_scale)
            self.encoder(self.v, self.value_quantizer, v, slot_mapping, None, self.value_scale)
        elif self._encode_natively(k, v, slot_mapping):
            return  # the window's tokens went with the codes
        else:
            self.k.view(-1, *self.k.shape[2:])[slot_mapping] = self.key_quantizer.quantize(self.scaled_keys(k))
            self.v.view(-1, *self.v.shape[2:])[slot_mapping] = self.value_quantizer.quantize(self.scaled_values(v))
        if self.window is not None:
            self.window.write(k, v)

    def _encode_natively(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> bool:
        """Codes and window in kernels/turboquant_encode.c, one call each for K and V: `RecentWindow.write`
        is a gather, a cast and an indexed write for each (34 us a layer on AMD EPYC Zen 3)."""
        window, keys, values = self.window, None, None
        if window is not None:
            keys, values = (window.k, window.staging.writes), (window.v, window.staging.writes)
        key_encoder, value_encoder = self.native_encoders
        return (_native_write(key_encoder, self.k, k, slots, keys)
                and _native_write(value_encoder, self.v, v, slots, values))

    @functools.cached_property
    def native_encoders(self) -> tuple[abi.TurboQuantEncode, abi.TurboQuantEncode]:
        """kernels/turboquant_encode.c's descriptions of the key and value encoders, built once: the calibration
        fixes what they point to (a layer's two, built per call, cost 8-40 us of Python a decode step's layer)."""
        if not self.calibrated:
            raise RuntimeError("the encoders depend on the calibration; calibrate first")
        return (native_encoder(self.k, self.key_quantizer, self.key_mean, self.key_scale),
                native_encoder(self.v, self.value_quantizer, None, self.value_scale))

    def gather_codes(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes through block tables [..., n_blocks] -> [..., n_blocks * block_size, H, nbytes]."""
        k = self.k[block_tables].flatten(-4, -3)
        v = self.v[block_tables].flatten(-4, -3)
        return k, v

    def codes_by_head(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes through block tables [..., n_blocks] -> [..., H, n_blocks * block_size, nbytes], contiguous."""
        return _by_head(self.k, block_tables), _by_head(self.v, block_tables)

    def gather(self, block_table: torch.Tensor, length: int, dtype: torch.dtype):
        """Dequantized, in the dense cache's layout: [num_kv_heads, length, head_dim]."""
        k, v = self._dequantize(*self.gather_codes(block_table), dtype)
        return k[:length].transpose(0, 1), v[:length].transpose(0, 1)

    def gather_batch(self, block_tables: torch.Tensor, dtype: torch.dtype):
        """Dequantized, in the dense cache's layout: [num_kv_heads, B, L, head_dim]."""
        k, v = self._dequantize(*self.gather_codes(block_tables), dtype)
        return k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)

    def _dequantize(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype):
        keys = self.key_quantizer.dequantize(k) * self.key_scale + self.key_mean
        return keys.to(dtype), (self.value_quantizer.dequantize(v) * self.value_scale).to(dtype)


def _rows(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Zeroed code rows with `row_slack` bytes allocated after the last one."""
    count = math.prod(shape)
    return torch.zeros(count + row_slack(device), dtype=torch.uint8, device=device)[:count].view(shape)


def row_slack(device: torch.device) -> int:
    """Bytes past the last row that the native decode kernel's wide loads may read (never as codes):
    its own figure on the CPU where it is built, else none."""
    lib = abi.kernels() if device.type == "cpu" else None
    return 0 if lib is None else lib.turboquant_row_slack


def _native_write(call: abi.TurboQuantEncode, rows: torch.Tensor, x: torch.Tensor, slots: torch.Tensor,
                  staged: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None) -> bool:
    """Encode x [T, H, D] into rows [num_blocks, block_size, H, nbytes] at slots with kernels/turboquant_encode.c,
    as `call` (native_encoder's description of rows) says, and given `staged` (a window's pool [n, H, D], float32
    or bf16, and its (token, row) pairs) copy those tokens' x there too; False where it does not run."""
    lib = abi.kernels() if rows.device.type == "cpu" else None
    if lib is None or (staged is not None and staged[0].dtype not in (torch.float32, torch.bfloat16)):
        return False
    x, slots = x.float().contiguous(), slots.to(torch.int64).contiguous()
    call.x, call.slots, call.tokens, call.threads = x.data_ptr(), slots.data_ptr(), x.shape[0], abi.threads()
    call.staged, call.staged_count = None, 0
    if staged is not None:
        pool, (tokens, staged_rows) = staged
        call.staged, call.staged_bf16 = pool.data_ptr(), pool.dtype == torch.bfloat16
        call.staged_tokens, call.staged_rows = tokens.data_ptr(), staged_rows.data_ptr()
        call.staged_count = len(tokens)
    return lib.turboquant_encode(call) == 0


def native_encoder(rows: torch.Tensor, quantizer: TurboQuantizer, mean: torch.Tensor | None = None,
                   scale: torch.Tensor | None = None) -> abi.TurboQuantEncode:
    """kernels/turboquant_encode.c's description of an encoder into `rows`, the call's rows, slots and tokens
    unset; mean and scale must be contiguous and live as long as it is used (the cache's own do)."""
    info, constants = quantizer.encode_tables
    heads, nbytes = rows.shape[2:]
    return abi.TurboQuantEncode(None, _pointer(mean), _pointer(scale), _pointer(quantizer.channel_order),
                                info.data_ptr(), constants.data_ptr(), None, rows.data_ptr(), 0, len(info), heads,
                                quantizer.dim, nbytes, 0)


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _by_head(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    # index_select of whole blocks, then one small uint8 copy: attention's matmuls then read
    # contiguous per-head rows (advanced indexing and strided operands measured much slower)
    num_blocks, block_size, heads, nbytes = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, tables.flatten())
    return rows.view(*tables.shape[:-1], -1, heads, nbytes).transpose(-3, -2).contiguous()


def _quantizer(dim: int, bits: float, mode: str, seed: int) -> TurboQuantizer:
    return TurboQuantizer(dim, bits, mode=mode, seed=seed, norm_correction=mode == "mse")


def _pairs(per_pair: torch.Tensor) -> torch.Tensor:
    """A value per rotary pair [D/2] -> per channel [D]: channel i and i + D/2 share it."""
    return torch.cat([per_pair, per_pair], -1)


def _pair_mean(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> the same with each rotary pair's two channels replaced by their mean."""
    return _pairs(sum(x.chunk(2, -1)) / 2)


def _query_power(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Mean q_j^2 per KV head and channel, over tokens and the query heads that share the KV head."""
    return q.unflatten(1, (num_kv_heads, -1)).square().mean((0, 2))


def _balanced(power: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(power / weight)^(1/4) per head and channel, geometric mean 1: the scale s that minimises
    E|weighted error| * E|x / s|^2 (module docstring)."""
    scale = (_floored(power) / _floored(weight)) ** 0.25
    return scale / scale.log().mean(-1, keepdim=True).exp()


def _median_norm(x: torch.Tensor) -> torch.Tensor:
    """[T, Hk, D] -> [Hk, 1]: each head's median vector norm (1 where it is 0)."""
    median = x.norm(dim=-1).median(0).values[:, None]
    return torch.where(median > 0, median, 1.0)


def _floored(power: torch.Tensor) -> torch.Tensor:
    """Keep near-silent channels from getting an extreme sigma."""
    return power.clamp_min(1e-4 * power.mean(-1, keepdim=True).clamp_min(1e-12))

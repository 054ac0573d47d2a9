"""Paged K/V storage: one K and one V tensor per layer, indexed by physical block.

Shape per layer: [num_kv_heads, num_blocks, block_size, head_dim], head-major so that a
gather through block tables yields each head's context contiguous ([H, L, D]), ready for
attention matmuls without another copy. New tokens are written by slot (block_id *
block_size + offset); readers gather whole blocks through a block table. Only `num_key_value_heads` heads are stored: GQA/MQA never repeat K/V here.
"""
from __future__ import annotations

import torch

from slipstream.backends.cpu import abi
from slipstream.kvcache.dtype import KVCacheDtype
from slipstream.kvcache.recent_window import Staging, staging_blocks
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


class LayerKVCache:
    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        self.block_size = block_size
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v: [T, num_kv_heads, head_dim] for the step's new tokens."""
        lib = abi.kernels() if self._native(k, v) else None
        if lib is not None:
            heads, blocks, block_size, dim = self.k.shape
            lib.cache_write_bf16(k.data_ptr(), v.data_ptr(), self.k.data_ptr(), self.v.data_ptr(),
                                 slot_mapping.data_ptr(), k.shape[0], k.stride(0), heads, dim, blocks * block_size)
            return
        self.k.view(self.k.shape[0], -1, self.k.shape[-1])[:, slot_mapping] = self._store(k).transpose(0, 1)
        self.v.view(self.v.shape[0], -1, self.v.shape[-1])[:, slot_mapping] = self._store(v).transpose(0, 1)

    def _native(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """bf16 rows into a bf16 CPU cache, sharing one token stride (any, for one token)."""
        rows_packed = all(x.stride()[1:] == (x.shape[2], 1) for x in (k, v))
        return (k.dtype == v.dtype == self.k.dtype == torch.bfloat16 and self.k.device.type == "cpu" and rows_packed
                and (k.shape[0] == 1 or k.stride(0) == v.stride(0)))

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        if self.k.dtype == torch.float8_e4m3fn:  # saturate: an out-of-range cast is NaN on some devices
            x = x.clamp(-FP8_MAX, FP8_MAX)
        return x.to(self.k.dtype)

    def gather(self, block_table: torch.Tensor, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one sequence's first `length` tokens: [num_kv_heads, length, head_dim]."""
        return self._gather(self.k, block_table, dtype)[:, :length], self._gather(self.v, block_table, dtype)[:, :length]

    def gather_batch(self, block_tables: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V through padded block tables [B, max_blocks]: [H, B, max_blocks*block_size, D], contiguous."""
        batch = block_tables.shape[0]
        k = self._gather(self.k, block_tables.flatten(), dtype)
        v = self._gather(self.v, block_tables.flatten(), dtype)
        return k.view(k.shape[0], batch, -1, k.shape[-1]), v.view(v.shape[0], batch, -1, v.shape[-1])

    @staticmethod
    def _gather(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # index_select on whole flattened blocks copies ~4x faster than advanced indexing
        heads, num_blocks, block_size, dim = cache.shape
        rows = cache.view(heads, num_blocks, block_size * dim).index_select(1, blocks)
        return rows.view(heads, -1, dim).to(dtype)


DEFAULT_STAGING_SHARE = 8
# A sliding-window layer reads no token older than its window; one this short (Gemma 3's 512) keeps the whole of it
# in 16 bits and reads no codes. Mistral's 4,096 would cost 16-bit bytes for 4k tokens of every layer and sequence.
WHOLE_WINDOW_TOKENS = 1024


class KVCache:
    """All layers' caches, sized from a memory budget; layers may differ in KV heads and head size.

    With TurboQuant, the first and last `dense_layers` layers keep a bf16/fp32 cache, and
    with `recent_tokens` R or `sink_tokens` S > 0 each TurboQuant layer also keeps the newest R and
    the first S tokens of up to `max_num_seqs` sequences in 16 bits (`RecentWindow`), a sliding-window layer
    whose window W is at most WHOLE_WINDOW_TOKENS its newest W instead; that staging
    memory is taken from `memory` before the blocks are counted. With both None (the dtype name's
    defaults) the staging takes at most 1/DEFAULT_STAGING_SHARE of `memory`, so a default never costs
    most of a small budget: `window_seqs` then says how many sequences it serves at once; and the default R is
    at least such a W (`_local_window`).
    """

    def __init__(self, layer_shapes: list[tuple[int, int]], kv_dtype: KVCacheDtype, model_dtype: torch.dtype,
                 memory: int, block_size: int, device: torch.device, dense_layers: int = 0,
                 recent_tokens: int | None = None, max_num_seqs: int = 1, sink_tokens: int | None = None,
                 key_turns: list[torch.Tensor | None] | None = None,
                 sliding_windows: list[int | None] | None = None,
                 value_weights: list[torch.Tensor | None] | None = None):
        """key_turns: per layer, the radians each rotary channel pair of its keys turns over the positions
        served (TurboQuantLayerCache's calibration), or None; sliding_windows: per layer, its window or None;
        value_weights: per layer, its value channels' output-projection energy [Hk, D] (the same), or None."""
        n = len(layer_shapes)
        self.turboquant = [kv_dtype.is_turboquant and dense_layers <= i < n - dense_layers for i in range(n)]
        self.kv_dtype = kv_dtype
        self.dense_dtype = kv_dtype.dense or model_dtype
        self.window_dtype = model_dtype if model_dtype.itemsize == 2 else torch.bfloat16
        self.bytes_per_token = self.bytes_per_token_of(layer_shapes, kv_dtype, model_dtype, dense_layers)
        self.block_size = block_size
        self._size_window(recent_tokens, sink_tokens, max_num_seqs, memory // DEFAULT_STAGING_SHARE,
                          layer_shapes, sliding_windows or [None] * n)
        self.num_blocks = (memory - self.window_memory) // (self.bytes_per_token * block_size)
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory={memory} bytes is too small for one block "
                             f"({self.bytes_per_token * block_size} bytes) after {self.window_memory} bytes "
                             f"of 16-bit staging (kv_cache_recent_tokens={self.recent_tokens}, "
                             f"kv_cache_sink_tokens={self.sink_tokens})")
        self.stagings = {window: Staging(*window, self.num_blocks, self._span(window) * self.window_seqs, block_size,
                                         device) for window in set(filter(None, self.layer_windows))}
        turns, weights = key_turns or [None] * n, value_weights or [None] * n
        self.layers = [self._layer(i, heads, dim, device, turns[i], weights[i])
                       for i, (heads, dim) in enumerate(layer_shapes)]

    def _size_window(self, recent_tokens: int | None, sink_tokens: int | None, max_num_seqs: int, default_share: int,
                     layer_shapes: list[tuple[int, int]], sliding_windows: list[int | None]) -> None:
        """The 16-bit window (recent_tokens, sink_tokens; layer_windows: each layer's (recent, sinks) or None),
        how many sequences it serves (window_seqs) and its bytes (window_memory).

        Explicit knobs get staging for max_num_seqs sequences. The dtype name's defaults get at most
        `default_share` bytes, whole sequences' worth, and `window_seqs` says how many that is: the
        engine schedules no more at once, so that every sequence it runs reads its window in 16 bits and a
        request's output never depends on what else is running. Too little for one: codes alone."""
        spec = self.kv_dtype
        self.recent_tokens = spec.recent_tokens if recent_tokens is None else recent_tokens
        if recent_tokens is None and self.recent_tokens:
            self.recent_tokens = max(self.recent_tokens, self._local_window(sliding_windows))
        self.sink_tokens = spec.sink_tokens if sink_tokens is None else sink_tokens
        if not spec.is_turboquant:
            self.recent_tokens = self.sink_tokens = 0
        self.layer_windows = [self._layer_window(tq, sliding) for tq, sliding in zip(self.turboquant, sliding_windows)]
        row_bytes = 2 * self.block_size * self.window_dtype.itemsize  # a staging block's K and V, per (head, dim)
        per_seq = sum(self._span(window) * heads * dim * row_bytes
                      for window, (heads, dim) in zip(self.layer_windows, layer_shapes) if window)
        self.window_seqs = max_num_seqs
        if per_seq and recent_tokens is None and sink_tokens is None:
            self.window_seqs = min(max_num_seqs, default_share // per_seq)
            if not self.window_seqs:
                self.recent_tokens = self.sink_tokens = per_seq = 0
                self.layer_windows = [None] * len(layer_shapes)
                self.window_seqs = max_num_seqs
        self.window_memory = per_seq * self.window_seqs

    def _local_window(self, sliding_windows: list[int | None]) -> int:
        """The longest sliding window that a TurboQuant layer keeps whole in 16 bits, or 0: the name's default
        window for the other layers is at least that long. Gemma 3 270M at 32k, tq2.5 on the prose: its 3 global
        layers at 64 recent tokens +3.23% perplexity / KL 0.0184, at 512 +2.50% / 0.0149, for 1.3 MiB more staging
        a sequence (9.3 MiB with the sliding layers' 8.0)."""
        return max((w for w, tq in zip(sliding_windows, self.turboquant) if tq and _kept_whole(w)), default=0)

    def _layer_window(self, turboquant: bool, sliding: int | None) -> tuple[int, int] | None:
        if not turboquant or not (self.recent_tokens or self.sink_tokens):
            return None
        if _kept_whole(sliding):
            return sliding, 0  # the layer reads nothing older, sinks included
        return self.recent_tokens, self.sink_tokens

    def _span(self, window: tuple[int, int] | None) -> int:
        return staging_blocks(*window, self.block_size, 1) if window else 0

    @staticmethod
    def bytes_per_token_of(layer_shapes: list[tuple[int, int]], kv_dtype: KVCacheDtype,
                           model_dtype: torch.dtype = torch.bfloat16, dense_layers: int = 0) -> int:
        """K and V of one token, all layers. `layer_shapes`: (num_kv_heads, head_dim) per layer."""
        n, total = len(layer_shapes), 0
        for i, (heads, dim) in enumerate(layer_shapes):
            if kv_dtype.is_turboquant and dense_layers <= i < n - dense_layers:
                total += TurboQuantLayerCache.bytes_per_token(heads, dim, kv_dtype.key_bits, kv_dtype.key_mode,
                                                              kv_dtype.value_bits)
            else:
                total += 2 * heads * dim * (kv_dtype.dense or model_dtype).itemsize
        return total

    def _layer(self, index: int, heads: int, dim: int, device: torch.device, key_turns: torch.Tensor | None,
               value_weights: torch.Tensor | None):
        if self.turboquant[index]:
            return TurboQuantLayerCache(self.num_blocks, self.block_size, heads, dim, self.kv_dtype.key_bits,
                                        self.kv_dtype.key_mode, seed=index, device=device,
                                        dense_dtype=self.window_dtype, value_bits=self.kv_dtype.value_bits,
                                        key_turns=key_turns, staging=self.stagings.get(self.layer_windows[index]),
                                        value_weights=value_weights)
        return LayerKVCache(self.num_blocks, self.block_size, heads, dim, self.dense_dtype, device)

    def describe(self) -> str:
        """What the dtype name means here, as the start-up line says it."""
        spec = self.kv_dtype
        if not spec.is_turboquant:
            return str(self.dense_dtype).replace("torch.", "")
        keys = f"{spec.key_bits:g}-bit keys" + (" (QJL)" if spec.key_mode == "prod" else "")
        whole = sorted({w[0] for w in self.layer_windows if w and w != (self.recent_tokens, self.sink_tokens)})
        sliding = f", sliding layers' whole {'/'.join(map(str, whole))}-token window" if whole else ""
        window = (f"newest {self.recent_tokens} and first {self.sink_tokens} tokens in 16 bits{sliding}, "
                  f"{self.window_memory / 2**20:.1f} MiB of staging for {self.window_seqs} sequences at once"
                  if self.window_memory else "codes alone")
        return f"{spec.name} ({keys}, {spec.value_bits:g}-bit values; {window})"

    def stale_head(self, blocks: list[int]) -> int:
        """How many of a prefix-cache hit's first `blocks` to compute again: its sink blocks, once other sequences'
        windows took their staging. Read from codes, they would cost the hit's sequence to its end: SmolLM2 tq3,
        6,144 cached tokens hit after 2,048 others, KL to the bf16 cache over the next 1,024 tokens 0.0178 without
        the hit, 0.0719 with it, 0.0699 with only the sink block's staging taken (Gemma 3: 0.0047, 0.0134, 0.0117);
        the window's other tokens cost 0.0005."""
        return max((staging.sink_blocks for staging in self.stagings.values() if not staging.holds_sinks(blocks)),
                   default=0)

    @property
    def needs_calibration(self) -> bool:
        return any(not getattr(layer, "calibrated", True) for layer in self.layers)

    def finish_calibration(self) -> None:
        """After the calibration prompt ran: fix every TurboQuant layer's constants."""
        for layer in self.layers:
            if not getattr(layer, "calibrated", True):
                layer.finish_calibration()


def _kept_whole(sliding: int | None) -> bool:
    """Whether a layer with this sliding window (None: none) stages the whole of it in 16 bits."""
    return sliding is not None and sliding <= WHOLE_WINDOW_TOKENS

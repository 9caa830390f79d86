"""The key/value cache of a batch of sequences.

Layout: one tensor `store` of shape [2L, B, H_kv, C, D] holding every layer's keys (entries 0 .. L-1) and
values (entries L .. 2L-1); `keys[l]` and `values[l]` are views of it. Row b holds its `lengths[b]`
cached tokens left-aligned in slots 0 .. lengths[b]-1, in sequence order; slots past a row's length
hold stale but finite values and are never attended. Rows may have different lengths. C, the capacity,
is a multiple of `block` and follows the live tokens: it grows (by a quarter at least, `reserve`; doubling
up to `limit` where the rows' most tokens are known) when a write would overflow and shrinks when the
longest rows leave, so memory is proportional to max(lengths) x live rows (rows that leave a batch in place
are freed at the next growth). One tensor for all layers makes the edits below one indexing op each instead
of one per layer and per key/value.

A forward over T new tokens writes them at slots lengths[b] .. lengths[b]+T-1 (`write`) and then
advances the lengths (`advance`). Everything a decoding loop needs afterwards is a method here, so no
index arithmetic leaks into the engine:
  - `rollback(lengths)`: forget tokens past the given lengths (rejected drafts);
  - `retract(n)`: forget the last n tokens of every row (a drafter's tree slots, written alike in all rows);
  - `compact(base, keep, counts)`: keep only chosen new slots, moved to follow `base` (the accepted path
    of a tree draft);
  - `select_rows(rows)`: drop or reorder sequences (finished ones leave the batch, in place);
  - `fork(counts)`: repeat each row counts[b] times (n samples of one prompt share one prefill);
  - `concat(caches)`: join batches (admitting freshly prefilled requests).
Keys and values of a bf16 model on the CPU are stored in bf16 where tlt's kernels run (their attention
reads bf16 keys and values into float32 arithmetic; at 8 rows of 1,500 cached tokens the cache is
more bytes per step than the weights, so half of them is a faster step) and in float32 otherwise
(`cache_dtype`): CPU batched matmuls in bf16 cost 2-5x their float32 twins at decode sizes, so the
operator path runs attention in float32. Either cache holds the same values (bf16-rounded keys and
values); the kernels' attention over a bf16 cache weighs most keys with bf16-rounded weights (AMX tiles or
AVX-512 bf16 dot products over paired values), so the two agree within that rounding rather than bit for bit.
Attention masks of a bf16 cache stay float32 (`mask_dtype`).
A bf16 cache on the CPU keeps its values `paired`: slots 2i and 2i + 1 of a row share the 2 D elements of
their two slot rows, dimension d of slot s at element 2 d + s % 2 (`pairs` is that view). It is the layout
in which AMX tiles multiply weights by values over slots as the values lie (a B tile is 32 slots x 16
dimensions), and in which one AVX-512 bf16 dot product adds two slots' products to 16 dimensions, so the
kernels' attention reads the cache without repacking it each step; everything here that moves single slots (`write`, `compact`) goes through `pairs`, and `write` hands the operator path
its values in the usual layout.
Where tlt's kernels run without AMX, such a cache also keeps its keys `packed_keys`: each 32 slots of a row's kv
head are one weight group of the kernels' products (dimension pair p of slot s at pair (s // 32, p, s % 32) of
the view `key_slots`), so the AVX-512 attention multiplies the queries by the keys as they lie instead of packing
every cached key each call (bench policy, 32 rows x 800 cached tokens: 0.92-0.93x the attention's time; heads of
128 dimensions, four queries a kv head, one token a row: 0.71-0.74x). AMX tiles read natural keys as they lie, so there the keys keep the usual layout. The
capacity, a multiple of `block`, is then a multiple of 32 too, so whatever copies whole ranges of slots from 0
(growth, row moves, joins) copies whole groups, and single slots go through `key_slots`.
The shortest and longest row lengths are kept as Python ints next to `lengths`, read once per change
(not at all when every row advances alike), so writes and masks do not read them from the device.
"""

from __future__ import annotations

import torch


GROWTH = 1.25  # the least factor by which a full cache's capacity grows (`reserve`)
BOUNDED_GROWTH = 2.0  # the same below a known `limit`, which bounds the memory it may take


def pairs(values: torch.Tensor) -> torch.Tensor:
    """Paired values [..., C, D] (C even) as the view [..., C / 2, 2, D]: slot s is [..., s // 2, s % 2, :]."""
    *lead, C, D = values.shape
    return values.view(*lead, C // 2, D, 2).transpose(-1, -2)


def natural(values: torch.Tensor) -> torch.Tensor:
    """Paired values [..., C, D] in the usual layout (a copy)."""
    return pairs(values).reshape(values.shape)


KEY_GROUP = 32  # slots per group of packed keys (the kernels' weight group, cpu_kernels.GROUP)


def key_slots(keys: torch.Tensor) -> torch.Tensor:
    """Packed keys [..., C, D] (C a multiple of KEY_GROUP) as the view [..., C / KEY_GROUP, KEY_GROUP, D / 2, 2]:
    slot s is [..., s // KEY_GROUP, s % KEY_GROUP, :, :], its D dimensions as D / 2 pairs."""
    *lead, C, D = keys.shape
    return keys.view(*lead, C // KEY_GROUP, D // 2, KEY_GROUP, 2).transpose(-3, -2)


def natural_keys(keys: torch.Tensor) -> torch.Tensor:
    """Packed keys [..., C, D] in the usual layout (a copy)."""
    return key_slots(keys).reshape(keys.shape)


def slot_view(t: torch.Tensor, group: int) -> torch.Tensor:
    """Paired values (group 2) or packed keys (group KEY_GROUP) [..., C, D] as the view [..., C / group, group, D / 2,
    2] in which slot s is [..., s // group, s % group, :, :], its D elements as D / 2 pairs: one indexing op writes or
    moves single slots of either layout."""
    return pairs(t).unflatten(-1, (-1, 2)) if group == 2 else key_slots(t)


def packs_keys(paired: bool, block: int) -> bool:
    """Whether a cache with values `paired` and capacity steps of `block` keeps its keys packed by default:
    where tlt's kernels run without AMX (module docstring)."""
    if not paired or block % KEY_GROUP:
        return False
    from tlt.model import cpu_kernels

    module = cpu_kernels.loaded()
    return module is not None and not module.amx()


def cache_dtype(dtype: torch.dtype, device: torch.device, head_dim: int) -> torch.dtype:
    """The dtype keys and values of a model in `dtype` on `device` with heads of `head_dim` are cached
    in (module docstring)."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return dtype
    from tlt.model import cpu_kernels, packed

    on_kernels = packed.KERNELS and head_dim <= cpu_kernels.MAX_HEAD_DIM and cpu_kernels.kernels() is not None
    return torch.bfloat16 if on_kernels else torch.float32


def mask_dtype(cache_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the additive attention masks over a cache in `cache_dtype` (float32 for a bf16 cache
    on the CPU, as tlt's kernels and the float32 operator path read them)."""
    return torch.float32 if cache_dtype == torch.bfloat16 and torch.device(device).type == "cpu" else cache_dtype


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        block: int = 64,
        paired: bool | None = None,
        packed_keys: bool | None = None,
        limit: int | None = None,
    ) -> None:
        """paired: values in the paired layout (module docstring); None: where the cache is bf16 on the CPU.
        packed_keys: keys in the kernels' packed layout (module docstring); None: where the values are paired,
        `block` is a multiple of 32 and tlt's kernels run without AMX.
        limit: the most slots a row is expected to need (a rollout's prompt, new tokens and a draft's slots),
        up to which the capacity doubles as it grows (`reserve`); None: unknown."""
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"limit must be a positive int or None, got {limit!r}")
        self.num_layers, self.num_kv_heads, self.head_dim, self.block = num_layers, num_kv_heads, head_dim, block
        self.limit = limit
        self.dtype, self.device = dtype, torch.device(device)
        if paired is None:
            paired = dtype == torch.bfloat16 and self.device.type == "cpu"
        if paired and (block % 2 or dtype != torch.bfloat16):
            raise ValueError(f"paired values need a bf16 cache and an even block, got {dtype} and block {block}")
        self.paired = paired
        if packed_keys is None:
            packed_keys = packs_keys(paired, block)
        if packed_keys and (block % KEY_GROUP or dtype != torch.bfloat16):
            raise ValueError(f"packed keys need a bf16 cache and a block that is a multiple of {KEY_GROUP}, got {dtype} "
                             f"and block {block}")
        self.packed_keys = packed_keys
        # slots a layout's unit holds, keys then values: 1 the usual layout (slot_view's groups otherwise)
        self.groups = (KEY_GROUP if packed_keys else 1, 2 if paired else 1)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.store = self._empty(batch_size, 0)

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int, **kwargs) -> "KVCache":
        c = model.config
        p = next(model.parameters())
        kwargs.setdefault("dtype", cache_dtype(p.dtype, p.device, c.head_dim))
        kwargs.setdefault("device", p.device)
        return cls(c.num_hidden_layers, batch_size, c.num_key_value_heads, c.head_dim, **kwargs)

    def _empty(self, batch: int, capacity: int) -> torch.Tensor:
        # Zeros, not uninitialised memory: attention multiplies masked slots' values by a weight of 0,
        # and 0 x NaN garbage would still poison the output.
        return torch.zeros(2 * self.num_layers, batch, self.num_kv_heads, capacity, self.head_dim,
                           dtype=self.dtype, device=self.device)

    def _like(self, lengths: torch.Tensor, store: torch.Tensor) -> "KVCache":
        out = object.__new__(KVCache)
        out.__dict__.update(self.__dict__)
        out.lengths, out.store = lengths, store  # the setters refresh the bounds and the views
        return out

    # --- layout ------------------------------------------------------------------------------------
    @property
    def store(self) -> torch.Tensor:
        return self._store

    @store.setter
    def store(self, value: torch.Tensor) -> None:
        self._store = value
        self.keys = list(value[: self.num_layers])  # [B, H_kv, C, D] views, one per layer
        self.values = list(value[self.num_layers :])

    # --- size --------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self._store.shape[3]

    @property
    def lengths(self) -> torch.Tensor:
        return self._lengths

    @lengths.setter
    def lengths(self, value: torch.Tensor) -> None:
        # The bounds are read by every layer's write; computing them once per change, not once per
        # layer, keeps device-to-host syncs off the decode loop.
        self._lengths = value
        self._bounds = (int(value.min()), int(value.max())) if value.numel() else (0, 0)

    @property
    def max_length(self) -> int:
        return self._bounds[1]

    @property
    def min_length(self) -> int:
        return self._bounds[0]

    @property
    def fit(self) -> int:
        """The slots that hold every row's tokens: the longest row rounded up to a block (whole value pairs),
        within the capacity."""
        return min(-(-self.max_length // self.block) * self.block, self.capacity)

    def nbytes(self) -> int:
        """Bytes held by the store (rows dropped in place still count until the next growth)."""
        return self._store.untyped_storage().nbytes()

    def _resize(self, capacity: int) -> None:
        keep = min(capacity, self.capacity)
        new = torch.empty(*self._store.shape[:3], capacity, self.head_dim, dtype=self.dtype, device=self.device)
        new[..., :keep, :] = self._store[..., :keep, :]
        new[..., keep:, :] = 0  # as `_empty`: no garbage in slots attention may weigh by 0
        self.store = new

    def reserve(self, new_tokens: int) -> None:
        """Make room for `new_tokens` more tokens in every row: at least what they need and at least GROWTH
        times the capacity, rounded up to a block. Growing by a block at a time would copy the whole cache
        every `block` tokens, quadratic in a response's length (24 rows decoding 600 tokens of the bench
        policy: 0.93 s of copies in a 23 s run); geometric growth copies it a logarithmic number of times
        for at most a quarter more memory. Below a known `limit` the capacity doubles instead (but never past
        the limit unless a write needs it): every copy together then costs about one copy of the final cache
        instead of four (bench policy, 48 rows of up to 1,540 tokens: growth took 0.49-0.57 s of a 12-15 s run
        by quarters, 0.34 s doubling)."""
        need = self.max_length + new_tokens
        if need > self.capacity:
            if self.limit is not None and need <= self.limit:
                grown = min(int(self.capacity * BOUNDED_GROWTH), self.limit)
            else:
                grown = int(self.capacity * GROWTH)
            self._resize(-(-max(need, grown) // self.block) * self.block)

    def shrink(self) -> None:
        """Release capacity beyond the longest row (rounded up to a block)."""
        if self.fit < self.capacity:
            self._resize(self.fit)

    # --- writing -----------------------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new k/v [B, H_kv, T, D] after each row's cached tokens; return keys/values [B, H_kv, S, D]
        covering slots 0 .. max_length+T-1 (the caller masks each row's slots past lengths[b]+T)."""
        T = k.shape[2]
        longest = self.max_length
        if longest + T > self.capacity:
            self.reserve(T)
        equal = self.min_length == longest  # rows of equal length (prefill, batch 1): one slice of slots for all
        if equal:
            slots = torch.arange(longest, longest + T, device=self.device) if max(self.groups) > 1 else None
        else:
            slots = self.lengths[:, None] + torch.arange(T, device=self.device)  # [B, T]
            rows = torch.arange(self.batch_size, device=self.device)[:, None].expand_as(slots)
        end, out = longest + T, []
        for buf, new, g in ((self.keys[layer], k, self.groups[0]), (self.values[layer], v, self.groups[1])):
            new = new.to(self.dtype) if equal else new.transpose(1, 2).to(self.dtype)  # [B, T, H_kv, D] unequal
            if g == 1 and equal:
                buf[:, :, longest:end] = new
            elif g == 1:
                buf[rows, :, slots] = new
            elif equal:
                slot_view(buf, g)[:, :, slots // g, slots % g] = new.unflatten(-1, (-1, 2))
            else:
                slot_view(buf, g)[rows, :, slots // g, slots % g] = new.unflatten(-1, (-1, 2))
            # the usual layout for the operator path, of the slots it reads (whole units of the layout)
            whole = buf[:, :, : -(-end // g) * g]
            out.append(whole if g == 1 else slot_view(whole, g).reshape(whole.shape)[:, :, :end])
        return out[0], out[1]

    def buffers(self, layer: int, T: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """For a kernel that writes T new tokens itself, at slots lengths[b] .. lengths[b]+T-1 of row b:
        the layer's key and value buffers [B, H_kv, C, D] with room for them (keys `packed_keys` or not, values
        `paired` or not),
        and S = longest row + T, the slots attention then reads (as `write` returns them)."""
        if self.max_length + T > self.capacity:
            self.reserve(T)
        return self.keys[layer], self.values[layer], self.max_length + T

    def advance(self, counts: torch.Tensor | int) -> None:
        """Count `counts` (per row or for all) freshly written tokens as cached."""
        if isinstance(counts, int):  # every row grows alike: the bounds shift without a device read
            self._lengths = self._lengths + counts
            self._bounds = (self._bounds[0] + counts, self._bounds[1] + counts)
        else:
            self.lengths = self.lengths + counts

    # --- editing -----------------------------------------------------------------------------------
    def rollback(self, lengths: torch.Tensor | int) -> None:
        """Truncate row b to lengths[b] tokens (an int applies to every row)."""
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.device).expand(self.batch_size)
        if bool((lengths > self.lengths).any()) or bool((lengths < 0).any()):
            raise ValueError("rollback can only shorten rows")
        self.lengths = lengths.clone()

    def retract(self, n: int) -> None:
        """Forget the last `n` tokens of every row: `rollback(lengths - n)` without reading the lengths."""
        if not 0 <= n <= self.min_length:
            raise ValueError(f"retract({n}): rows hold {self.min_length} tokens at least")
        self._lengths = self._lengths - n
        self._bounds = (self._bounds[0] - n, self._bounds[1] - n)

    def compact(self, base: torch.Tensor, keep: torch.Tensor, counts: torch.Tensor) -> None:
        """For row b keep the new slots base[b] + keep[b, j] for j < counts[b], moved to base[b] + j,
        and drop the rest: the accepted path of a verified tree. keep: [B, K] ascending offsets."""
        B, K = keep.shape
        if K == 0:
            self.rollback(base)
            return
        kernels = self.kernels()
        if kernels is not None:  # one call for every layer, row and head instead of indexing ops
            kernels.compact(self._store, self.num_layers, base.long().contiguous(), keep.long().contiguous(),
                            counts.long().contiguous(), self.paired, self.packed_keys)
            self.lengths = base + counts
            return
        s = self._store
        natural_store = self.groups == (1, 1)
        if natural_store and (lo := int(base.min())) == int(base.max()):  # one start (batch 1, unpadded drafts)
            new = s[..., lo : self.max_length, :]  # [2L, B, H_kv, W, D] the new slots
            index = keep[None, :, None, :, None].expand(s.shape[0], B, s.shape[2], K, s.shape[4])
            s[..., lo : lo + K, :] = new.gather(3, index)
        else:
            # Only the kept slots j < counts[b] move (as the kernel does): keep past a row's count may
            # be padding, or point outside the cache for a row that keeps nothing (counts 0).
            kept = torch.arange(K, device=self.device) < counts[:, None]  # [B, K]
            src = (base[:, None] + keep)[kept]  # [N] over the kept (row, j)
            dst = (base[:, None] + torch.arange(K, device=self.device))[kept]
            rows = torch.arange(B, device=self.device)[:, None].expand(B, K)[kept]
            if natural_store:
                s[:, rows, :, dst] = s[:, rows, :, src]
            else:  # keys, then values, by slot in their layouts
                for half, g in ((s[: self.num_layers], self.groups[0]), (s[self.num_layers :], self.groups[1])):
                    view = half.unsqueeze(-2) if g == 1 else slot_view(half, g)
                    view[:, rows, :, dst // g, dst % g] = view[:, rows, :, src // g, src % g]
        self.lengths = base + counts

    def kernels(self):
        """tlt's CPU kernels where they hold this cache (bf16 on the CPU: `cache_dtype` chose it for them),
        else None."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16:
            return None
        from tlt.model import cpu_kernels

        return cpu_kernels.loaded()

    def mask_kernels(self):
        """A compiled module whose `tree_mask` builds this cache's attention masks in one pass: tlt's bf16 kernels
        for a bf16 cache, its float32 kernel for a float32 CPU cache where a model's products have loaded it
        (tlt/model/cpu_f32.py), else None (the masks are then built by operators, the same values)."""
        if self.device.type == "cpu" and self.dtype == torch.float32:
            from tlt.model import cpu_f32

            return cpu_f32.loaded()
        return self.kernels()

    def select_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Keep (and reorder) the given rows. Where most rows stay and every row that moves comes from a
        higher index (finished rows leaving a large batch, the rows behind them moving down or the last
        ones filling their places), the moved rows are copied one by one in place, their live slots only,
        and the dropped rows' memory goes at the next growth; the capacity stays, so the next write does
        not reallocate. A copy of every kept row into a fresh allocation would cost the whole cache, twice
        over, each time a row finishes (bench policy, 16 x 8 samples of up to 1,540 tokens: 14% of a
        rollout under tree-d8-k2-v12). Otherwise (a reorder, a fork, few rows kept) the kept rows are
        copied and the dropped rows' memory is released."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        n, index = rows.numel(), rows.tolist()
        moves = [(i, r) for i, r in enumerate(index) if r != i]
        self.lengths = self.lengths[rows]
        fit = self.fit
        if 2 * n >= self._store.shape[1] and all(r > i for i, r in moves):
            # In ascending order of destination, a move never overwrites a row a later move reads.
            for i, r in moves:
                self._store[:, i, :, :fit] = self._store[:, r, :, :fit]
            self.store = self._store[:, :n]
        else:
            self.store = self._store[:, rows, :, :fit]

    def fork(self, counts: torch.Tensor | list[int]) -> None:
        """Repeat row b counts[b] times, in place (rows stay grouped)."""
        counts = torch.as_tensor(counts, dtype=torch.long, device=self.device)
        self.select_rows(torch.repeat_interleave(torch.arange(self.batch_size, device=self.device), counts))

    @staticmethod
    def concat(caches: list["KVCache"]) -> "KVCache":
        """One cache holding the rows of all `caches`, in order, at the largest of their capacities. Each
        cache's live slots are copied once into the new store and the rest of its rows zeroed (padding
        each store to the capacity first and then joining them would copy everything twice)."""
        caches = [c for c in caches if c.batch_size]
        if not caches:
            raise ValueError("concat needs at least one non-empty cache")
        first = caches[0]
        if any(c.groups != first.groups for c in caches):
            raise ValueError("concat: the caches hold their keys or values in different layouts (paired, packed_keys)")
        cap = max(c.capacity for c in caches)
        limits = [c.limit for c in caches]
        store = torch.empty(2 * first.num_layers, sum(c.batch_size for c in caches), first.num_kv_heads, cap,
                            first.head_dim, dtype=first.dtype, device=first.device)
        row = 0
        for c in caches:
            rows = slice(row, row + c.batch_size)
            store[:, rows, :, : c.fit] = c.store[:, :, :, : c.fit]
            store[:, rows, :, c.fit :] = 0  # as `_empty`: no garbage in slots attention may weigh by 0
            row += c.batch_size
        joined = first._like(torch.cat([c.lengths for c in caches]), store)
        joined.limit = None if None in limits else max(limits)
        return joined

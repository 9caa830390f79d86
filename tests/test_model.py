"""The model against transformers, and cached / tree / packed forwards against the plain full forward."""

import pytest
import torch

import tlt
from tlt.model import KVCache
from tlt.model.kv_cache import natural, natural_keys, pairs

ROPE_CASES = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen3": dict(tie_word_embeddings=True),
}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_logits_match_transformers_on_padded_batch(hf_folder, arch):
    hf, folder = hf_folder(arch, **ROPE_CASES[arch])
    model = tlt.load_model(folder)
    torch.manual_seed(1)
    ids = torch.randint(3, 97, (3, 40))
    right = torch.ones_like(ids)
    right[1, 30:] = 0
    right[2, 11:] = 0
    with torch.no_grad():
        ref = hf(ids, attention_mask=right).logits
        got = model(ids, attention_mask=right).logits
    assert (ref - got)[right.bool()].abs().max() <= 1e-4

    left = right.flip(1)
    pos = (left.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(ids, attention_mask=left, position_ids=pos).logits
        got = model(ids, attention_mask=left).logits
    assert (ref - got)[left.bool()].abs().max() <= 1e-4


def test_rope_scaling_changes_logits(hf_folder):
    """Guards the test above: without the scaling the logits must differ, so it was really exercised."""
    _, plain = hf_folder("llama", seed=3)
    _, scaled = hf_folder("llama", seed=3, **ROPE_CASES["llama"])
    ids = torch.randint(3, 97, (1, 40))
    with torch.no_grad():
        a = tlt.load_model(plain)(ids).logits
        b = tlt.load_model(scaled)(ids).logits
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["default", "qwen3"])
def test_load_model_puts_every_tensor_on_the_requested_device(hf_folder, name):
    # The meta device stands in for a GPU: the loaded weights must not stay where safetensors read them.
    source = hf_folder("qwen3", **ROPE_CASES["qwen3"])[1] if name == "qwen3" else "default"
    model = tlt.load_model(source, device="meta", dtype=torch.bfloat16)
    assert {t.device.type for t in [*model.parameters(), *model.buffers(), model.inv_freq]} == {"meta"}
    assert model.device.type == "meta" and model.dtype == torch.bfloat16
    # Built on the meta device, a model loaded onto the CPU keeps no tensor behind there.
    model = tlt.load_model(source)
    assert {t.device.type for t in [*model.parameters(), *model.buffers(), model.inv_freq]} == {"cpu"}


def test_sharded_checkpoint_loads(tmp_path):
    from conftest import tiny_hf_model

    hf = tiny_hf_model("llama", hidden_size=128, intermediate_size=256)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        assert (hf(ids).logits - tlt.load_model(tmp_path)(ids).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_saved_model_loads_in_transformers(tiny_model, tmp_path, arch):
    from transformers import AutoModelForCausalLM

    names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    model = tiny_model(architecture=names[arch], qk_norm=arch == "qwen3", qkv_bias=arch == "qwen2",
                       tie_word_embeddings=arch == "llama")
    model.save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 61, (2, 17))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids).logits).abs().max() <= 1e-4
        assert (tlt.load_model(tmp_path)(ids).logits - model(ids).logits).abs().max() == 0


def test_packed_rows_equal_separate_sequences(tiny_model):
    model = tiny_model()
    a, b = torch.randint(0, 61, (1, 7)), torch.randint(0, 61, (1, 5))
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
    with torch.no_grad():
        out = model(packed, position_ids=pos).logits
        assert (out[:, :7] - model(a).logits).abs().max() <= 1e-5
        assert (out[:, 7:] - model(b).logits).abs().max() <= 1e-5


@pytest.mark.parametrize("rows", [3, 9])  # 9: a CPU decode step of 8+ rows takes attend's matmul path
def test_cached_decoding_equals_full_forward(tiny_model, rows):
    model = tiny_model()
    ids = torch.randint(0, 61, (rows, 30))
    lengths = torch.tensor([10, 6, 8, 4, 10, 7, 9, 5, 6][:rows])  # prompts of different lengths, right-padded
    valid = torch.arange(10)[None] < lengths[:, None]
    cache = model.new_cache(rows, block=8)
    with torch.no_grad():
        full = model(ids).logits
        prefill = model(ids[:, :10] * valid, attention_mask=valid, cache=cache)
        assert cache.lengths.tolist() == lengths.tolist()
        for b in range(rows):
            n = int(lengths[b])
            assert (prefill.logits[b, :n] - full[b, :n]).abs().max() <= 1e-5
        # Each row continues from its own length: feed row b the token at its own next position.
        for _ in range(15):
            step = torch.stack([ids[b, cache.lengths[b]] for b in range(rows)])[:, None]
            before = cache.lengths.clone()
            out = model(step, cache=cache).logits[:, 0]
            for b in range(rows):
                assert (out[b] - full[b, before[b]]).abs().max() <= 1e-5
    assert cache.capacity % 8 == 0 and cache.capacity >= cache.max_length


def random_tree(T: int, seed: int) -> list[int]:
    """parents[i] < i, -1 for children of the cached prefix."""
    g = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, T)]


def ancestors(parents: list[int]) -> torch.Tensor:
    T = len(parents)
    m = torch.eye(T, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] |= m[p]
    return m


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_tree_forward_equals_each_path(tiny_model):
    model = tiny_model()
    prefix = torch.randint(0, 61, (2, 9))
    T = 12
    parents = random_tree(T, seed=4)
    tree_tokens = torch.randint(0, 61, (2, T))
    depth = torch.tensor([len(path_to(parents, i)) - 1 for i in range(T)])
    with torch.no_grad():
        cache = model.new_cache(2)
        model(prefix, cache=cache)
        out = model(tree_tokens, position_ids=9 + depth.expand(2, T), tree_mask=ancestors(parents), cache=cache)
        for node in range(T):
            path = path_to(parents, node)
            ref = model(torch.cat([prefix, tree_tokens[:, path]], 1)).logits[:, -1]
            assert (out.logits[:, node] - ref).abs().max() <= 1e-5


def test_compaction_and_rollback_equal_direct_cache(tiny_model):
    model = tiny_model()
    prefix = torch.randint(0, 61, (2, 9))
    T = 10
    parents = random_tree(T, seed=5)
    tree_tokens = torch.randint(0, 61, (2, T))
    depth = torch.tensor([len(path_to(parents, i)) - 1 for i in range(T)])
    keep = [path_to(parents, T - 1), path_to(parents, 4)]
    K = max(len(k) for k in keep)
    keep_idx = torch.tensor([k + [0] * (K - len(k)) for k in keep])
    nxt = torch.randint(0, 61, (2, 1))
    with torch.no_grad():
        cache = model.new_cache(2)
        model(prefix, cache=cache)
        model(tree_tokens, position_ids=9 + depth.expand(2, T), tree_mask=ancestors(parents), cache=cache)
        cache.compact(torch.tensor([9, 9]), keep_idx, torch.tensor([len(k) for k in keep]))
        got = model(nxt, cache=cache).logits[:, 0]
        for b in range(2):
            ref = model(torch.cat([prefix[b], tree_tokens[b, keep[b]], nxt[b]])[None]).logits[0, -1]
            assert (got[b] - ref).abs().max() <= 1e-5

        seq = torch.cat([prefix, tree_tokens], 1)
        cache = model.new_cache(2)
        model(seq, cache=cache)
        cache.rollback(torch.tensor([9, 12]))
        got = model(nxt, cache=cache).logits[:, 0]
        for b, n in enumerate([9, 12]):
            ref = model(torch.cat([seq[b, :n], nxt[b]])[None]).logits[0, -1]
            assert (got[b] - ref).abs().max() <= 1e-5


def test_fork_select_concat_equal_separate_prefills(tiny_model):
    model = tiny_model()
    a, b = torch.randint(0, 61, (1, 7)), torch.randint(0, 61, (1, 11))
    with torch.no_grad():
        ca, cb = model.new_cache(1), model.new_cache(1)
        model(a, cache=ca)
        model(b, cache=cb)
        ca.fork([3])
        cache = KVCache.concat([ca, cb])
        assert cache.lengths.tolist() == [7, 7, 7, 11]
        cache.select_rows([3, 0, 2])  # drop one forked row, reorder
        nxt = torch.randint(0, 61, (3, 1))
        got = model(nxt, cache=cache).logits[:, 0]
        for row, prompt in enumerate([b, a, a]):
            ref = model(torch.cat([prompt[0], nxt[row]])[None]).logits[0, -1]
            assert (got[row] - ref).abs().max() <= 1e-5
    assert cache.nbytes() > 0


def logical_store(cache: KVCache) -> torch.Tensor:
    """The cache's store with its keys and values in the usual layout (packed keys unpacked, paired values
    unpaired)."""
    L = cache.num_layers
    keys, values = cache.store[:L], cache.store[L:]
    return torch.cat([natural_keys(keys) if cache.packed_keys else keys, natural(values) if cache.paired else values])


@pytest.mark.parametrize("kernel", [True, False])
def test_a_cache_of_packed_keys_holds_what_a_cache_of_the_usual_layout_holds(kernel, monkeypatch):
    """A bf16 cache with packed keys (and paired values) against one with both in the usual layout, through what
    a rollout does to a cache: writes to rows of equal and unequal lengths (what `write` returns too), growth past
    a block, tree compaction (the kernel, and the indexing path with the kernel off), rows dropped in place and
    reordered, a fork, a join with a fresh cache, a rollback and a shrink. After each, every row's live slots hold
    the same keys and values."""
    if not kernel:
        monkeypatch.setattr(KVCache, "kernels", lambda self: None)
    L, H, D = 2, 2, 6
    gen = torch.Generator().manual_seed(9)
    make = lambda B, packed: KVCache(L, B, H, D, dtype=torch.bfloat16, block=32, paired=packed, packed_keys=packed)
    caches = [make(4, False), make(4, True)]
    assert [c.packed_keys for c in caches] == [False, True]

    def same():
        a, b = caches
        assert torch.equal(a.lengths, b.lengths)
        for row, n in enumerate(a.lengths.tolist()):
            assert torch.equal(logical_store(a)[:, row, :, :n], logical_store(b)[:, row, :, :n])

    def write(T):
        for layer in range(L):
            k = torch.randn(caches[0].batch_size, H, T, D, generator=gen).bfloat16()
            v = torch.randn(caches[0].batch_size, H, T, D, generator=gen).bfloat16()
            a, b = (c.write(layer, k, v) for c in caches)
            for row, n in enumerate((caches[0].lengths + T).tolist()):
                assert torch.equal(a[0][row, :, :n], b[0][row, :, :n]) and torch.equal(a[1][row, :, :n], b[1][row, :, :n])
        for c in caches:
            c.advance(T)
        same()

    write(5)  # equal lengths
    for c in caches:
        c.compact(torch.tensor([2, 2, 2, 2]), torch.tensor([[0, 2], [1, 2], [0, 1], [2, 0]]), torch.tensor([2, 2, 2, 1]))
    same()
    write(9)
    for c in caches:  # rows of unequal lengths from here
        c.compact(torch.tensor([6, 5, 7, 4]), torch.tensor([[1, 3, 4], [0, 2, 5], [2, 3, 8], [0, 1, 2]]),
                  torch.tensor([3, 2, 1, 0]))
    same()
    for _ in range(6):
        write(7)  # past the first block: growth
    assert caches[1].capacity > 32 and caches[1].capacity % 32 == 0
    for c in caches:
        c.select_rows([0, 2, 3])  # a finished row: the rows behind move down in place
    same()
    for c in caches:
        c.fork([2, 1, 1])
    same()
    fresh = [make(2, p) for p in (False, True)]  # freshly prefilled rows: 40 and 17 tokens
    for layer in range(L):
        k, v = (torch.randn(2, H, 40, D, generator=gen).bfloat16() for _ in range(2))
        for f in fresh:
            f.write(layer, k, v)
    for f in fresh:
        f.advance(40)
        f.rollback(torch.tensor([40, 17]))
    caches = [KVCache.concat([c, f]) for c, f in zip(caches, fresh)]
    same()
    write(3)
    for c in caches:
        c.rollback(c.lengths - torch.tensor([1, 0, 2, 3, 4, 5]))
        c.shrink()
    same()
    with pytest.raises(ValueError, match="layouts"):
        KVCache.concat([make(1, False), make(1, True)])


@pytest.mark.parametrize("paired", [False, True])
def test_writes_to_rows_of_different_lengths_land_in_their_slots(paired):
    """`KVCache.write` on rows of different lengths against writing each row's slots one by one: across
    layers, a capacity growth, dropped rows, and lengths handed back edited in place; float32 values and
    bf16 ones in the paired layout (what write returns is the usual layout)."""
    torch.manual_seed(0)
    L, H, D = 3, 2, 4
    dtype = torch.bfloat16 if paired else torch.float32
    cache = KVCache(L, 3, H, D, block=8, dtype=dtype)
    assert cache.paired == paired
    ref = torch.zeros(2 * L, 3, H, 64, D, dtype=dtype)  # the expected store, written slot by slot

    def write(T, in_place=False):
        lengths = cache.lengths.tolist()
        for layer in range(L):
            k, v = torch.randn(cache.batch_size, H, T, D).to(dtype), torch.randn(cache.batch_size, H, T, D).to(dtype)
            keys, values = cache.write(layer, k, v)
            for b, n in enumerate(lengths):
                ref[layer, b, :, n : n + T] = k[b]
                ref[L + layer, b, :, n : n + T] = v[b]
            assert keys.shape[2] == values.shape[2] == max(lengths) + T
            for b, n in enumerate(lengths):
                assert torch.equal(values[b, :, : n + T], ref[L + layer, b, :, : n + T])
        if in_place:
            cache.lengths += T  # the lengths tensor `write` indexed from, edited in place and set back
        else:
            cache.advance(T)
        for b, n in enumerate(cache.lengths.tolist()):
            assert torch.equal(logical_store(cache)[:, b, :, :n], ref[:, b, :, :n])

    cache.lengths = torch.tensor([2, 5, 3])
    write(1)
    write(3)
    write(6)  # 5 + 1 + 3 + 6 = 15 > the first block: the store grows
    assert cache.capacity == 16
    cache.select_rows([2, 0])
    ref = ref[:, [2, 0]]
    write(1, in_place=True)
    write(1)
    assert cache.capacity == 16


@pytest.mark.parametrize("bases", [[5, 5, 5], [5, 3, 7]])
@pytest.mark.parametrize("kernel", [True, False])
def test_compaction_moves_paired_values_with_their_slots(bases, kernel, monkeypatch):
    """`compact` on a bf16 cache, values paired or not, keeps the same slots as the indexing path on a float32
    cache of the same values, whether the rows' accepted paths start at one slot or at several (odd and even
    starts, odd and even moves); also with the kernel turned off (the indexing path of paired values)."""
    if not kernel:
        monkeypatch.setattr(KVCache, "kernels", lambda self: None)
    L, B, H, D = 2, 3, 2, 4
    data = torch.randn(2 * L, B, H, 16, D).bfloat16()
    # a float32 cache of the same values (the indexing path) against bf16 ones (tlt's kernels where they run)
    caches = [KVCache(L, B, H, D, dtype=torch.float32, block=8)]
    caches += [KVCache(L, B, H, D, dtype=torch.bfloat16, block=8, paired=p) for p in (False, True)]
    for c in caches:
        c.reserve(16)
        c.lengths = torch.tensor([12, 12, 12])
    caches[0].store.copy_(data)
    caches[1].store.copy_(data)
    caches[2].store[:L] = data[:L]
    pairs(caches[2].store[L:])[:] = data[L:].view(2 * L - L, B, H, 8, 2, D)
    keep = torch.tensor([[0, 2, 3], [1, 4, 0], [0, 1, 2]])
    for c in caches:
        c.compact(torch.tensor(bases), keep, torch.tensor([3, 2, 3]))
    for c in caches:
        assert c.lengths.tolist() == [b + n for b, n in zip(bases, [3, 2, 3])]
        for b, n in enumerate(c.lengths.tolist()):
            assert torch.equal(logical_store(c)[:, b, :, :n].float(), logical_store(caches[0])[:, b, :, :n])


@pytest.mark.parametrize("dtype,paired,kernel", [(torch.float32, False, False), (torch.bfloat16, True, False),
                                                 (torch.bfloat16, True, True)])
def test_compaction_moves_only_the_kept_slots_of_each_row(dtype, paired, kernel, monkeypatch):
    """Offsets past a row's count are not read: a row that keeps nothing (count 0, its cache left as it
    is) may carry offsets that point past the cache, as `DraftState.trim` gives the rows it leaves alone;
    the indexing path moves what the kernel moves."""
    if not kernel:
        monkeypatch.setattr(KVCache, "kernels", lambda self: None)
    L, B, H, D = 1, 2, 2, 4
    cache = KVCache(L, B, H, D, dtype=dtype, block=8, paired=paired)
    cache.reserve(16)
    cache.lengths = torch.tensor([14, 15])
    cache.store.normal_(generator=torch.Generator().manual_seed(5))
    before = logical_store(cache).clone()
    keep = torch.tensor([[10, 11, 12, 13], [11, 12, 13, 14]])  # row 1: base 15 + 11.. is past the 16 slots
    cache.compact(torch.tensor([0, 15]), keep, torch.tensor([4, 0]))
    assert cache.lengths.tolist() == [4, 15]
    after = logical_store(cache)
    assert torch.equal(after[:, 0, :, :4], before[:, 0, :, 10:14])  # row 0: its newest four, moved to the front
    assert torch.equal(after[:, 1], before[:, 1])  # row 1: untouched


@pytest.mark.parametrize("paired", [False, True])
def test_rows_dropped_in_place_keep_the_same_slots_and_free_their_memory_at_the_next_growth(paired):
    """`select_rows` keeping most rows in order moves the rows behind a dropped one down in place: every
    kept row holds what it held, in keys and (paired) values alike; the dropped rows' memory is held
    until the next growth; a selection that reorders or keeps few rows copies as before."""
    L, B, H, D = 2, 5, 2, 4
    dtype = torch.bfloat16 if paired else torch.float32
    cache = KVCache(L, B, H, D, dtype=dtype, block=8)
    cache.reserve(16)
    cache.store.normal_(generator=torch.Generator().manual_seed(3))
    cache.lengths = torch.tensor([16, 9, 12, 5, 16])
    before = logical_store(cache).clone()
    held = cache.nbytes()
    cache.select_rows([0, 2, 4])  # rows 1 and 3 finished
    assert cache.lengths.tolist() == [16, 12, 16] and cache.batch_size == 3
    for new, old in enumerate([0, 2, 4]):
        n = cache.lengths[new]
        assert torch.equal(logical_store(cache)[:, new, :, :n], before[:, old, :, :n])
    assert cache.nbytes() == held  # in place: nothing freed yet
    cache.reserve(1)  # the next growth allocates the three rows only
    assert cache.nbytes() < held and cache.capacity == 24
    for new, old in enumerate([0, 2, 4]):
        n = cache.lengths[new]
        assert torch.equal(logical_store(cache)[:, new, :, :n], before[:, old, :, :n])
    cache.select_rows([2, 0])  # reordered: copied
    assert cache.lengths.tolist() == [16, 16]
    assert torch.equal(logical_store(cache)[:, 0, :, :16], before[:, 4, :, :16])
    # a cache whose rows left in place (a strided view of its old store) compacts and joins like a fresh one
    cache = KVCache(L, B, H, D, dtype=dtype, block=8)
    cache.reserve(16)
    cache.store.normal_(generator=torch.Generator().manual_seed(4))
    cache.lengths = torch.tensor([16, 9, 12, 5, 16])
    cache.select_rows([0, 2, 4])
    fresh = KVCache(L, 3, H, D, dtype=dtype, block=8)
    fresh.reserve(16)
    fresh.store.copy_(cache.store)
    fresh.lengths = cache.lengths.clone()
    for c in (cache, fresh):
        c.compact(torch.tensor([10, 8, 10]), torch.tensor([[1, 3], [0, 2], [2, 5]]), torch.tensor([2, 2, 2]))
    joined = [KVCache.concat([c, fresh]) for c in (cache, fresh)]
    assert torch.equal(joined[0].lengths, joined[1].lengths)
    for b, n in enumerate(joined[0].lengths.tolist()):
        assert torch.equal(logical_store(joined[0])[:, b, :, :n], logical_store(joined[1])[:, b, :, :n])


@pytest.mark.parametrize("paired", [False, True])
def test_rows_filled_from_the_tail_move_in_place_and_keep_the_capacity(paired):
    """Finished rows' places taken by the last rows (`fill_from_tail`): only those rows move, in place;
    every kept row holds what it held; the capacity and the memory stay until the next growth, so the
    next write does not reallocate."""
    from tlt.rollout.batch import fill_from_tail

    L, B, H, D = 2, 6, 2, 4
    dtype = torch.bfloat16 if paired else torch.float32
    cache = KVCache(L, B, H, D, dtype=dtype, block=8)
    cache.reserve(24)
    cache.store.normal_(generator=torch.Generator().manual_seed(6))
    cache.lengths = torch.tensor([7, 16, 3, 12, 5, 9])
    before, held, storage = logical_store(cache).clone(), cache.nbytes(), cache.store.data_ptr()
    rows = fill_from_tail([True, False, True, False, True, True])  # rows 1 and 3 finished
    assert rows == [0, 4, 2, 5]
    cache.select_rows(rows)
    assert cache.lengths.tolist() == [7, 5, 3, 9] and cache.capacity == 24
    assert cache.nbytes() == held and cache.store.data_ptr() == storage  # in place
    for new, old in enumerate(rows):
        n = cache.lengths[new]
        assert torch.equal(logical_store(cache)[:, new, :, :n], before[:, old, :, :n])
    k, v = torch.randn(4, H, 1, D).to(dtype), torch.randn(4, H, 1, D).to(dtype)
    cache.write(0, k, v)
    assert cache.store.data_ptr() == storage  # room left: no reallocation
    assert fill_from_tail([False, False, True]) == [2] and fill_from_tail([True, True]) == [0, 1]
    assert fill_from_tail([False, True, False, True]) == [3, 1]


def test_cache_grows_geometrically():
    """A cache written one token at a time reallocates a logarithmic number of times (each growth copies
    the whole cache), never past a quarter more than it needs plus a block, and keeps what it held."""
    cache = KVCache(2, 3, 2, 4, block=8)
    ref = torch.randn(4, 3, 2, 1000, 4)
    growths, capacity = 0, cache.capacity
    for t in range(1000):
        keys, values = (ref[i * 2 : i * 2 + 2, :, :, t : t + 1] for i in range(2))
        for layer in range(2):
            cache.write(layer, keys[layer], values[layer])
        cache.advance(1)
        if cache.capacity != capacity:
            growths += 1
            assert cache.capacity % 8 == 0 and cache.capacity <= max(t + 1, 1.25 * capacity) + 8
            capacity = cache.capacity
    assert growths <= 20  # a block at a time: 125
    assert torch.equal(cache.store[..., :1000, :], ref)


def test_cache_with_a_known_limit_doubles_up_to_it_and_concat_keeps_the_largest():
    """Below a known limit the capacity doubles (fewer, larger growths) but never passes the limit (rounded up
    to a block) unless a write needs more; past it growth is geometric as without one. Joined caches keep
    the largest limit, or none where any is unknown; a bad limit is refused."""
    cache = KVCache(1, 2, 1, 4, block=8, limit=300)
    capacities = []
    for t in range(400):
        cache.write(0, torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4))
        cache.advance(1)
        if not capacities or capacities[-1] != cache.capacity:
            capacities.append(cache.capacity)
    assert capacities[:6] == [8, 16, 32, 64, 128, 256] and capacities[6] == 304  # the limit, to a block
    assert all(c <= max(304, 1.25 * p + 8) for p, c in zip(capacities, capacities[1:])) and capacities[-1] >= 400
    small = KVCache(1, 1, 1, 4, limit=100)
    assert KVCache.concat([cache, small]).limit == 300
    assert KVCache.concat([cache, KVCache(1, 1, 1, 4)]).limit is None
    with pytest.raises(ValueError, match="limit"):
        KVCache(1, 1, 1, 4, limit=0)


def test_cache_memory_follows_live_tokens(tiny_model):
    model = tiny_model()
    cache = model.new_cache(4, block=16)
    with torch.no_grad():
        model(torch.randint(0, 61, (4, 40)), cache=cache)
    big = cache.nbytes()
    cache.select_rows([0])
    assert cache.nbytes() * 4 <= big
    cache.rollback(5)
    cache.shrink()
    assert cache.capacity == 16


def test_tree_mask_over_trailing_cached_tokens(tiny_model):
    """A tree written level by level (each level cached before the next) equals the one-shot tree."""
    model = tiny_model()
    prefix = torch.randint(0, 61, (2, 6))
    parents = [-1, -1, 0, 0, 1, 2, 2, 4]  # levels: {0,1}, {2,3,4}, {5,6,7}
    levels = [[0, 1], [2, 3, 4], [5, 6, 7]]
    tokens = torch.randint(0, 61, (2, 8))
    anc = ancestors(parents)
    depth = torch.tensor([len(path_to(parents, i)) for i in range(8)])
    with torch.no_grad():
        cache = model.new_cache(2)
        model(prefix, cache=cache)
        whole = model(tokens, position_ids=5 + depth.expand(2, 8), tree_mask=anc, cache=cache).logits
        cache.rollback(6)
        written = []
        for level in levels:
            cols = written + level
            mask = anc[level][:, cols]  # [T, D + T]
            out = model(tokens[:, level], position_ids=5 + depth[level].expand(2, len(level)), tree_mask=mask,
                        cache=cache).logits
            assert (out - whole[:, level]).abs().max() <= 1e-5
            written = cols


def test_cpu_float32_linears_are_column_major_and_keep_values(tiny_model, tmp_path):
    """fp32 CPU weights are stored transposed in memory (for MKL's small-row products), every other
    dtype row-major; a cast or move chooses again, loading keeps the layout, files and outputs are the
    same as with row-major weights."""
    from tlt.model.layout import column_major_linears

    model = tiny_model(seed=4)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.stride() == (1, q.shape[0]) and model.model.embed_tokens.weight.is_contiguous()
    ids = torch.tensor([[5, 9, 14, 3, 7]])
    with torch.no_grad():
        expected = model(ids).logits
        rows = {n: p.contiguous() for n, p in model.named_parameters()}
        row_major = tiny_model(seed=4)
        for n, p in row_major.named_parameters():
            p.data = rows[n]
        assert torch.allclose(row_major(ids).logits, expected, atol=1e-5)
    model.save_pretrained(tmp_path / "m")
    loaded = tlt.load_model(tmp_path / "m")
    assert loaded.model.layers[1].mlp.down_proj.weight.t().is_contiguous()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)
        loaded.load_state_dict(row_major.state_dict())  # row-major tensors copied in: the layout stays
    assert loaded.model.layers[1].mlp.down_proj.weight.t().is_contiguous()
    half = model.to(torch.bfloat16)
    assert all(p.is_contiguous() for p in half.parameters())
    back = half.float()
    assert back.model.layers[0].self_attn.o_proj.weight.t().is_contiguous()
    assert column_major_linears(back) is back


def test_rope_tables_equal_direct_computation_and_follow_their_frequencies(tiny_model):
    from tlt.model.rope import RopeTables, rope_tables

    inv_freq = tiny_model().inv_freq
    tables = RopeTables()
    positions = torch.tensor([[0, 3, 255], [700, 1, 2]])  # 700: past the first table of 256 rows
    for pos in (positions[:, :1], positions):
        cos, sin = tables(pos, inv_freq, 1.0, torch.float32)
        ref_cos, ref_sin = rope_tables(pos, inv_freq, 1.0, torch.float32)
        assert cos.shape == ref_cos.shape == (*pos.shape, 1, inv_freq.numel() * 2)
        assert torch.allclose(cos, ref_cos, atol=1e-6) and torch.allclose(sin, ref_sin, atol=1e-6)
    assert tables.cos.shape[0] >= 701
    other = inv_freq * 0.5  # new frequencies: new tables
    assert torch.allclose(tables(positions, other, 1.0, torch.float32)[0], rope_tables(positions, other, 1.0,
                                                                                   torch.float32)[0], atol=1e-6)
    assert tables(positions, other, 2.0, torch.float32)[1].abs().max() > 1.5  # the scaling is applied
    assert tables(positions, other, 1.0, torch.bfloat16)[0].dtype == torch.bfloat16


def test_tables_built_in_inference_mode_serve_training(tiny_model):
    model = tiny_model(seed=1)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.inference_mode():
        model(ids)
    loss = model(ids).logits.logsumexp(-1).sum()
    loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
def test_attend_equals_scaled_dot_product_attention(heads, kv_heads):
    """Both of attend's paths (a one-token CPU step of 8+ rows, and the rest) against PyTorch's SDPA
    with the kv heads repeated, under an additive mask that hides some keys of each row."""
    import torch.nn.functional as F

    from tlt.model.transformer import attend

    g = torch.Generator().manual_seed(0)
    for B, T in [(9, 1), (2, 1), (9, 3)]:
        q, k, v = (torch.randn(B, h, n, 16, generator=g) for h, n in ((heads, T), (kv_heads, 20), (kv_heads, 20)))
        mask = torch.zeros(B, 1, T, 20).masked_fill(torch.rand(B, 1, T, 20, generator=g) < 0.3, float("-inf"))
        mask[..., -1] = 0  # every query sees at least one key
        repeat = heads // kv_heads
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
                                             attn_mask=mask)
        assert torch.allclose(attend(q, k, v, mask), ref, atol=1e-5)
        if T == 1:
            assert torch.allclose(attend(q, k, v, None), F.scaled_dot_product_attention(
                q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)), atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bf16_logits_within_bf16_rounding_of_transformers_bf16(hf_folder, arch):
    """bf16 on the CPU runs the fused step on tlt's kernels with a bf16 KV cache; its logits
    (a padded prefill, then cached decode steps of 1 and 3 tokens) stray from float32's no further than
    transformers' own bf16 forward does, on the same weights."""
    hf, folder = hf_folder(arch, **ROPE_CASES[arch])
    hf_half = type(hf).from_pretrained(folder, dtype=torch.bfloat16).eval()
    model = tlt.load_model(folder, dtype="bfloat16")
    ids = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        exact = hf(ids).logits
        theirs = hf_half(ids).logits.float()
        cache = model.new_cache(2)
        ours = torch.cat([model(ids[:, :20], cache=cache).logits, model(ids[:, 20:21], cache=cache).logits,
                          model(ids[:, 21:], cache=cache).logits], 1).float()
    assert model.model.layers[0]._fused.value is not None
    their_error = (theirs - exact).abs().max()
    assert (ours - exact).abs().max() <= 2 * their_error + 1e-2


def test_retract_equals_rollback_by_count():
    """`retract(n)` (a drafter forgetting its tree slots) leaves the lengths and bounds `rollback(lengths - n)`
    leaves, and refuses to drop more tokens than a row holds."""
    a, b = KVCache(1, 3, 2, 4), KVCache(1, 3, 2, 4)
    for cache in (a, b):
        cache.reserve(16)
        cache.lengths = torch.tensor([9, 5, 7])
        cache.advance(4)
    a.retract(6)
    b.rollback(torch.tensor([7, 3, 5]))
    assert torch.equal(a.lengths, b.lengths)
    assert (a.min_length, a.max_length) == (b.min_length, b.max_length) == (3, 7)
    with pytest.raises(ValueError):
        a.retract(4)


@pytest.mark.parametrize("paired", [False, True])
def test_concat_copies_each_rows_live_slots_and_zeroes_the_rest(paired):
    """Caches of different capacities join at the largest: every row's slots up to its cache's longest
    row (rounded to a block) are copied, the slots past it are zero, whatever the sources held there."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if paired else torch.float32
    caches = []
    for rows, lengths, capacity in ((2, [5, 9], 16), (3, [20, 3, 30], 48), (1, [2], 8)):
        c = KVCache(2, rows, 2, 4, block=8, dtype=dtype)
        c.store = torch.randn(4, rows, 2, capacity, 4).to(dtype)  # garbage past the lengths too
        c.lengths = torch.tensor(lengths)
        caches.append(c)
    joined = KVCache.concat(caches)
    assert joined.capacity == 48 and joined.lengths.tolist() == [5, 9, 20, 3, 30, 2]
    row = 0
    for c, fit in zip(caches, (16, 32, 8)):
        got = logical_store(joined)[:, row:row + c.batch_size]
        assert torch.equal(got[:, :, :, :fit], logical_store(c)[:, :, :, :fit])
        assert not got[:, :, :, fit:].any()
        row += c.batch_size

"""scripts/kernel_ab.py: two kernel builds compared for bits and time (here the built kernels against themselves
and against a copy whose attention is off by one bit, so nothing is compiled)."""

import json

import pytest
import torch

from tlt.model import cpu_kernels

kernels = cpu_kernels.kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="tlt's bf16 CPU kernels do not run on this machine")


class OffByOneBit:
    """The kernels, with the last bit of every attention output flipped."""

    def attention(self, *args, **layout):
        out = kernels.attention(*args, **layout)
        return (out.view(torch.int16) ^ 1).view(torch.bfloat16)

    def linear(self, *args):
        return kernels.linear(*args)


def run(script, capsys, modules):
    rc = script("kernel_ab").main(["old.cpp", "new.cpp", "--attention", "2,20,3", "--linear", "3", "--repeats", "2",
                                   "--threads", "1"], modules=modules)
    assert rc == 0
    return json.loads(capsys.readouterr().out)


def test_the_same_kernels_give_the_same_bits_and_are_timed_side_by_side(script, capsys):
    result = run(script, capsys, [kernels, kernels])
    assert result["same_bits"] and result["differs"] == []
    for figures in (result["attention"]["2,20,3"], result["linear"]["3"]):
        assert figures["old_ms"] > 0 and figures["new_ms"] > 0 and figures["new_over_old"] > 0


def test_fewer_weight_sets_run_the_same_twelve_layers_of_products(script, capsys):
    """--weight-sets 1: the twelve layers' products all take one layer's weights (the same calls otherwise)."""
    counted = []

    class Counting:
        attention = staticmethod(kernels.attention)

        def linear(self, x, w, *args):
            counted.append(w.data_ptr())
            return kernels.linear(x, w, *args)

    rc = script("kernel_ab").main(["old.cpp", "new.cpp", "--attention", "--linear", "3", "--repeats", "1",
                                   "--threads", "1", "--weight-sets", "1"], modules=[kernels, Counting()])
    assert rc == 0 and json.loads(capsys.readouterr().out)["linear"]["3"]["new_ms"] > 0
    timed = counted[-2 * 12 * 4:]  # two repeats (the warm-up and one timed) of twelve layers' four products
    assert len(set(timed)) == 4  # one layer's four weights, over and over
    with pytest.raises(SystemExit):
        script("kernel_ab").main(["a.cpp", "b.cpp", "--weight-sets", "13"])
    assert "expected 1 to 12 distinct sets of weights, got 13" in capsys.readouterr().err


class Recording:
    """The kernels, noting the (query heads, kv heads, head size) of every attention call."""

    def __init__(self):
        self.shapes = set()

    def attention(self, q, k, *args, **layout):
        self.shapes.add((q.shape[1], k.shape[1], q.shape[3]))
        return kernels.attention(q, k, *args, **layout)

    def linear(self, *args):
        return kernels.linear(*args)


def test_other_heads_are_checked_and_timed(script, capsys):
    """--heads: every bit check and timed call runs over 32 query heads of 128 on 8 kv heads."""
    recording = Recording()
    rc = script("kernel_ab").main(["old.cpp", "new.cpp", "--attention", "2,130,3", "--heads", "32,8,128",
                                   "--linear", "--repeats", "1", "--threads", "1"], modules=[kernels, recording])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["same_bits"] and result["attention"]["2,130,3"]["old_ms"] > 0
    assert recording.shapes == {(32, 8, 128)}


class Layouts:
    """The kernels, noting the keys' layout of every attention call (packed or not)."""

    def __init__(self):
        self.packed = set()

    def attention(self, *args, packed_keys=False):
        self.packed.add(packed_keys)
        return kernels.attention(*args, packed_keys=packed_keys)

    def linear(self, *args):
        return kernels.linear(*args)


def test_old_keys_natural_hands_old_the_usual_layout(script, capsys):
    """--old-keys natural: OLD reads the keys in the usual layout, NEW in the engine cache's (packed where the
    kernels run without AMX), and both give the same bits."""
    from tlt.model.kv_cache import packs_keys

    old, new = Layouts(), Layouts()
    rc = script("kernel_ab").main(["old.cpp", "new.cpp", "--attention", "2,70,3", "--linear", "--repeats", "1",
                                   "--threads", "1", "--old-keys", "natural"], modules=[old, new])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["same_bits"]
    assert old.packed == {False} and new.packed == {packs_keys(True, 64)}


def test_a_kernel_that_changes_a_bit_is_named(script, capsys):
    result = run(script, capsys, [kernels, OffByOneBit()])
    assert not result["same_bits"]
    assert result["differs"] and all(name.startswith("attention") for name in result["differs"])
    assert len(result["differs"]) == 7  # every attention case, no product


def test_bad_arguments_are_refused_with_what_was_expected(script, capsys):
    with pytest.raises(SystemExit):
        script("kernel_ab").main(["a.cpp", "b.cpp", "--attention", "1,2"])
    assert "expected B,S,T" in capsys.readouterr().err
    for heads in ("32,8", "12,8,64", "16,8,130"):
        with pytest.raises(SystemExit):
            script("kernel_ab").main(["a.cpp", "b.cpp", "--heads", heads])
        assert "H,KV,D" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script("kernel_ab").main(["/no/such/old.cpp", "b.cpp"])
    assert "/no/such/old.cpp: no such source file" in capsys.readouterr().err

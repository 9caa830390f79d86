"""The scripts: profile_decode.py's summary of py-spy's collapsed stacks (on a hand-made profile) and
rollout_fingerprint.py's samples hash."""

from pathlib import Path

import pytest

FUSED = Path(__file__).resolve().parent.parent / "tlt" / "model" / "fused.py"


def line_of(text: str) -> int:
    """The number of the line of tlt/model/fused.py that holds `text`."""
    return next(i for i, line in enumerate(FUSED.read_text().splitlines(), 1) if text in line)


def test_summary_splits_samples_by_layer_line_and_innermost_tlt_line(tmp_path, capsys, script):
    # py-spy names files relative to their sys.path entry (tlt/..., torch/...), or by absolute path.
    product, attention = line_of("gate_up = fused.gate_up("), line_of("out = attend(")
    step = "main (x.py:1);RolloutEngine.step (tlt/rollout/engine.py:313)"
    layer = step + ";DecoderLayer.forward (/src/tlt/model/transformer.py:123)"
    raw = tmp_path / "stacks.txt"
    raw.write_text("\n".join([
        "load (x.py:5);read (tlt/model/checkpoint.py:9) 50",  # outside the decode steps: ignored
        layer + f";fused_layer_step (tlt/model/fused.py:{product});linear (torch/nn/functional.py:1) 30",
        layer + f";fused_layer_step (tlt/model/fused.py:{attention});attend (tlt/model/attention.py:23) 10",
        step + ";expand (/src/tlt/speculative/tree.py:101);log_softmax (torch/nn/functional.py:7) 40",
        step + ";walk (tlt/speculative/verify.py:48);item (torch/_tensor.py:3) 20",
    ]) + "\n")
    profile = script("profile_decode")
    profile.summarize(raw, top=5)
    out = capsys.readouterr().out
    assert "100 samples in decode steps; 40.0% inside decoder layers" in out
    lines = out.splitlines()
    fused = sorted(lines[lines.index("fused layer step, by line (share of all decode samples):") + 1:][:2], reverse=True)
    assert fused[0].startswith(f"   30.0%  fused_layer_step (tlt/model/fused.py:{product})  ")
    assert fused[1].startswith(f"   10.0%  fused_layer_step (tlt/model/fused.py:{attention})  ")
    # Each line is shown with its source, read from the checkout.
    assert fused[0].endswith(profile.source(f"(tlt/model/fused.py:{product})")) and "fused.gate_up" in fused[0]
    assert any(x.startswith("   40.0%  expand (tlt/speculative/tree.py:101)") for x in lines)
    assert any(x.startswith("   20.0%  walk (tlt/speculative/verify.py:48)") for x in lines)


def test_summary_refuses_a_profile_without_decode_steps(tmp_path, script):
    raw = tmp_path / "stacks.txt"
    raw.write_text("load (x.py:5) 3\n")
    with pytest.raises(SystemExit, match="no samples inside RolloutEngine.step"):
        script("profile_decode").summarize(raw, top=5)


def test_rollout_fingerprint_gives_every_target_only_system_the_same_samples(script, capsys, monkeypatch):
    import json
    import sys

    import torch

    monkeypatch.setattr(sys, "argv", ["rollout_fingerprint", "--prompts", "2", "--samples", "2", "--max-tokens", "24",
                                      "--threads", "1"])
    threads = torch.get_num_threads()  # the script sets its own; the rest of the suite keeps this one
    try:
        script("rollout_fingerprint").main()
    finally:
        torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == {"off", "tree-d4-k2-v8", "adaptive"}
    assert len({r["samples_sha256"] for r in result.values()}) == 1
    assert all(r["tokens"] > 0 and r["wall_s"] > 0 for r in result.values())

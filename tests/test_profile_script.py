"""scripts/profile_decode.py's summary of py-spy's collapsed stacks, on a hand-made profile."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "profile_decode.py"


def load_script():
    spec = importlib.util.spec_from_file_location("profile_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_splits_samples_by_layer_line_and_innermost_tlt_line(tmp_path, capsys):
    # py-spy names files relative to their sys.path entry (tlt/..., torch/...), or by absolute path.
    step = "main (x.py:1);RolloutEngine.step (tlt/rollout/engine.py:313)"
    layer = step + ";DecoderLayer.forward (/src/tlt/model/transformer.py:123)"
    raw = tmp_path / "stacks.txt"
    raw.write_text("\n".join([
        "load (x.py:5);read (tlt/model/checkpoint.py:9) 50",  # outside the decode steps: ignored
        layer + ";fused_layer_step (tlt/model/fused.py:127);linear (torch/nn/functional.py:1) 30",
        layer + ";fused_layer_step (tlt/model/fused.py:136);attend (tlt/model/attention.py:23) 10",
        step + ";expand (/src/tlt/speculative/tree.py:101);log_softmax (torch/nn/functional.py:7) 40",
        step + ";walk (tlt/speculative/verify.py:48);item (torch/_tensor.py:3) 20",
    ]) + "\n")
    script = load_script()
    script.summarize(raw, top=5)
    out = capsys.readouterr().out
    assert "100 samples in decode steps; 40.0% inside decoder layers" in out
    lines = out.splitlines()
    fused = lines[lines.index("fused layer step, by line (share of all decode samples):") + 1:][:2]
    assert fused[0].startswith("   30.0%  fused_layer_step (tlt/model/fused.py:127)  ")
    assert fused[1].startswith("   10.0%  fused_layer_step (tlt/model/fused.py:136)  ")
    # Each line is shown with its source, read from the checkout.
    assert fused[0].endswith(script.source("(tlt/model/fused.py:127)")) and "F.linear" in fused[0]
    assert any(x.startswith("   40.0%  expand (tlt/speculative/tree.py:101)") for x in lines)
    assert any(x.startswith("   20.0%  walk (tlt/speculative/verify.py:48)") for x in lines)


def test_summary_refuses_a_profile_without_decode_steps(tmp_path):
    raw = tmp_path / "stacks.txt"
    raw.write_text("load (x.py:5) 3\n")
    with pytest.raises(SystemExit, match="no samples inside RolloutEngine.step"):
        load_script().summarize(raw, top=5)

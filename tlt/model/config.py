"""Model configuration, read from and written to Hugging Face `config.json`.

One dataclass describes every Llama-family decoder tlt runs. The three supported architectures differ
only in a few switches:

| architecture       | q/k/v bias          | o bias          | MLP bias   | q/k RMSNorm |
|--------------------|---------------------|-----------------|------------|-------------|
| LlamaForCausalLM   | `attention_bias`    | `attention_bias`| `mlp_bias` | no          |
| Qwen2ForCausalLM   | always              | never           | never      | no          |
| Qwen3ForCausalLM   | `attention_bias`    | `attention_bias`| never      | yes         |

A config.json is read as transformers reads it: a field it leaves out takes transformers' default for
its architecture, and a field that would change the function tlt cannot compute (an activation other
than SiLU, sliding-window attention, a rope type tlt lacks) is refused by name rather than ignored.
RoPE parameters are accepted in both the transformers 5 layout (`rope_parameters` holding `rope_theta`
and `rope_type`) and the older one (`rope_theta` plus `rope_scaling`), and always written in the new
one; a non-empty `rope_scaling` replaces `rope_parameters` whole, its `rope_theta` (else the top-level
one, else 10000) included, as in transformers. A yarn `factor` of null is, as there,
max_position_embeddings / original_max_position_embeddings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tlt.errors import ConfigError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

# transformers' defaults for fields a config.json may leave out, where they differ by architecture; a
# head_dim or num_key_value_heads not listed (or null) is hidden_size // num_attention_heads, or
# num_attention_heads.
_DEFAULTS = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
}
_SILU = ("silu", "swish")  # the `hidden_act` spellings of SiLU, the gate of tlt's SwiGLU MLP


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number(value: Any, name: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{source}: field {name!r} must be a number, got {value!r}")
    return float(value)


def _object(raw: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    value = raw.get(name) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: field {name!r} must be an object, got {value!r}")
    return dict(value)


def _flag(raw: dict[str, Any], name: str, source: str) -> bool:
    """A boolean field, false when absent or null; a string such as "false" is refused, not read as true."""
    value = raw.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: field {name!r} must be true or false, got {value!r}")
    return value


def _token_ids(raw: dict[str, Any], name: str, source: str, many: bool = False) -> Any:
    """A token id field: an integer or null (with `many`, also a list of integers). A string id would
    never equal a sampled token, so generation would silently never stop on it."""
    value = raw.get(name)
    ids = value if many and isinstance(value, list) else [value]
    if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        kind = "a token id or a list of token ids" if many else "a token id"
        raise ConfigError(f"{source}: field {name!r} must be {kind}, got {value!r}")
    return value


@dataclass(frozen=True)
class ModelConfig:
    """Shape and switches of one Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"architecture {self.architecture!r} is not supported; expected one of {sorted(ARCHITECTURES)}")
        for name in _REQUIRED + ("num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not _is_positive_int(value):
                raise ConfigError(f"field {name!r} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None:
            from tlt.model.rope import check_rope_scaling

            check_rope_scaling(self.rope_scaling)

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture]

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a parsed Hugging Face config; `source` names the file in error messages."""
        archs = raw.get("architectures")
        if not archs:
            model_type = raw.get("model_type")
            by_type = {v: k for k, v in ARCHITECTURES.items()}
            if model_type not in by_type:
                raise ConfigError(
                    f"{source}: field 'architectures' is missing and model_type {model_type!r} is not one of "
                    f"{sorted(by_type)}"
                )
            archs = [by_type[model_type]]
        if not isinstance(archs, list) or not isinstance(archs[0], str):
            raise ConfigError(f"{source}: field 'architectures' must be a list of class names, got {archs!r}")
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ConfigError(
                f"{source}: architectures value {arch!r} is not supported; expected one of {sorted(ARCHITECTURES)}"
            )
        for name in _REQUIRED:
            if name not in raw:
                raise ConfigError(f"{source}: required field {name!r} is missing")
            if not _is_positive_int(raw[name]):
                raise ConfigError(f"{source}: field {name!r} must be a positive integer, got {raw[name]!r}")
        if _flag(raw, "use_sliding_window", source):
            raise ConfigError(f"{source}: field 'use_sliding_window' is true; sliding-window attention is not supported")
        act = raw.get("hidden_act", "silu")
        if act not in _SILU:
            raise ConfigError(f"{source}: field 'hidden_act' is {act!r}; tlt's MLP is SwiGLU, expected one of {_SILU}")
        defaults = _DEFAULTS[arch]
        heads = raw["num_attention_heads"]
        max_positions = raw.get("max_position_embeddings", defaults["max_position_embeddings"])
        # transformers takes a non-empty rope_scaling instead of rope_parameters, not merged with it.
        parameters, scaled = _object(raw, "rope_parameters", source), _object(raw, "rope_scaling", source)
        rope_field, rope = ("rope_scaling", scaled) if scaled else ("rope_parameters", parameters)
        theta = _number(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)), "rope_theta", source)
        eps = _number(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", source)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type != "default":
            scaling = {k: v for k, v in rope.items() if k != "type"}
            scaling["rope_type"] = rope_type
            scaling.setdefault("original_max_position_embeddings", max_positions)
            original = scaling["original_max_position_embeddings"]
            if (rope_type == "yarn" and "factor" in scaling and scaling["factor"] is None
                    and _is_positive_int(max_positions) and _is_positive_int(original)):
                # transformers reads a null yarn factor as the ratio of the context lengths
                scaling["factor"] = max_positions / original
        qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = not qwen2 and _flag(raw, "attention_bias", source)  # Qwen2: fixed, see the table above
        mlp_bias = arch == "LlamaForCausalLM" and _flag(raw, "mlp_bias", source)
        tied = _flag(raw, "tie_word_embeddings", source)
        bos, pad = _token_ids(raw, "bos_token_id", source), _token_ids(raw, "pad_token_id", source)
        eos = _token_ids(raw, "eos_token_id", source, many=True)
        known = set(_REQUIRED) | {
            "architectures", "model_type", "num_key_value_heads", "head_dim", "max_position_embeddings",
            "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "use_sliding_window",
            "hidden_act",
        }
        try:
            if scaling is not None:
                from tlt.model.rope import check_rope_scaling

                check_rope_scaling(scaling, rope_field)  # named by the field it came from
            return cls(
                architecture=arch,
                vocab_size=raw["vocab_size"],
                hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                num_hidden_layers=raw["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=raw.get("num_key_value_heads", defaults.get("num_key_value_heads")) or heads,
                head_dim=raw.get("head_dim", defaults.get("head_dim")) or raw["hidden_size"] // heads,
                max_position_embeddings=max_positions,
                rms_norm_eps=eps,
                rope_theta=theta,
                rope_scaling=scaling,
                qkv_bias=True if qwen2 else attention_bias,
                o_bias=False if qwen2 else attention_bias,
                mlp_bias=mlp_bias,
                qk_norm=arch == "Qwen3ForCausalLM",
                tie_word_embeddings=tied,
                bos_token_id=bos,
                eos_token_id=eos,
                pad_token_id=pad,
                extra={k: v for k, v in raw.items() if k not in known},
            )
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json transformers expects for this architecture."""
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:
            rope.update(self.rope_scaling)
        out: dict[str, Any] = {
            k: v for k, v in self.extra.items() if k not in ("transformers_version", "dtype", "torch_dtype")
        }
        out.update(
            architectures=[self.architecture],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        if self.architecture != "Qwen2ForCausalLM":
            out["attention_bias"] = self.qkv_bias
        if self.architecture == "LlamaForCausalLM":
            out["mlp_bias"] = self.mlp_bias
        return out

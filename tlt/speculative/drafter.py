"""The EAGLE-1 drafter: one decoder layer on top of the target's own features.

At position t it reads the pair (f[t], x[t+1]), the target's feature at t and the token after it:

    h = fc(concat(embed(x[t+1]), f[t]))      2H -> H, with bias
    f_hat[t+1] = decoder_layer(h)            one Llama decoder layer with its own KV cache
    q(x[t+2]) = softmax(lm_head(f_hat[t+1]))

and f_hat[t+1] stands in for f[t+1] when drafting further ahead. The embedding and LM head are the
target's, referenced (never copied) and frozen; only fc and the layer train. f is the target's
last-layer feature after its final norm, so lm_head(f) are the target's logits and f_hat, which goes to
the LM head with no norm of its own, regresses exactly that feature.

The layer is EAGLE-1's whatever the target: a Llama layer (no q/k/v bias, no per-head q/k norm, no MLP
bias) of the target's width, heads and RoPE, whose input norm is the identity (attention reads fc's
output as it is); its post-attention norm stays. So the drafter is, tensor for tensor, the
`LlamaForCausalLMEagle` head SGLang and vLLM serve (speculative/export.py).

With `feature_layers` (EAGLE-3 style) the target feature is instead a learned fusion of the outputs of
several target layers (low, mid, high): fuse(concat(...)) kH -> H; the drafter's own outputs feed
deeper draft steps unchanged.

A drafter maps pairs at positions t to (f_hat[t+1], logits); the KV cache of its layer follows the
accepted tokens exactly as the target's does (see speculative/decoder.py).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tlt.errors import CheckpointError
from tlt.model.config import ModelConfig
from tlt.model.kv_cache import KVCache, cache_dtype, mask_dtype
from tlt.model.layout import ColumnMajorLinears
from tlt.model.packed import Prepared, inference_linear
from tlt.model.transformer import DecoderLayer, Transformer, additive, attention_mask_for, training_mask


@dataclass(frozen=True)
class DrafterConfig:
    target_architecture: str
    hidden_size: int
    vocab_size: int
    target_layers: int
    feature_layers: tuple[int, ...] | None = None
    target_name: str | None = None
    # The most pairs its attention has seen in training (train_drafter's `window`); None: not recorded.
    # An engine's drafter_window="auto" keeps its drafting attention within it.
    train_window: int | None = None

    @classmethod
    def for_target(cls, target: Transformer, feature_layers=None, target_name=None) -> "DrafterConfig":
        c = target.config
        return cls(c.architecture, c.hidden_size, c.vocab_size, c.num_hidden_layers,
                   tuple(feature_layers) if feature_layers else None, target_name)

    def check_target(self, target: Transformer, where: str) -> None:
        c = target.config
        for name, mine, theirs in (("target_architecture", self.target_architecture, c.architecture),
                                   ("hidden_size", self.hidden_size, c.hidden_size),
                                   ("vocab_size", self.vocab_size, c.vocab_size),
                                   ("target_layers", self.target_layers, c.num_hidden_layers)):
            if mine != theirs:
                raise CheckpointError(f"{where}: field {name!r} is {mine!r} but the target model has {theirs!r}")


def layer_config(target: ModelConfig) -> ModelConfig:
    """The drafter layer's config: the target's shape and RoPE as a plain Llama layer."""
    return target.replace(architecture="LlamaForCausalLM", num_hidden_layers=1, qkv_bias=False, o_bias=False,
                          mlp_bias=False, qk_norm=False)


def check_tensors(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str) -> None:
    """Refuse `state` unless it has exactly the names and shapes of `expected`, naming every difference."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{where}: not a drafter of tlt's layout (fc with bias; a Llama layer without input "
                              f"norm or q/k norm; no output norm): missing tensors {missing}, "
                              f"unexpected tensors {unexpected}; retrain it with tlt train-drafter")
    for k, v in state.items():
        if v.shape != expected[k].shape:
            raise CheckpointError(f"{where}: tensor {k!r} has shape {tuple(v.shape)}, expected {tuple(expected[k].shape)}")


class Drafter(ColumnMajorLinears, nn.Module):
    def __init__(self, target: Transformer, config: DrafterConfig | None = None) -> None:
        super().__init__()
        self.config = config or DrafterConfig.for_target(target)
        H = target.config.hidden_size
        # The target is held outside the module tree: its weights are neither trained nor saved here.
        self.__dict__["target"] = target
        self.fc = nn.Linear(2 * H, H, bias=True)
        self._fc = Prepared()  # fc's PackedLinear for inference
        self.weight_bits = 16  # of fc's and the layer's inference weights (set_weight_bits)
        self.layer = DecoderLayer(layer_config(target.config), input_norm=False)
        if self.config.feature_layers:
            self.fuse = nn.Linear(len(self.config.feature_layers) * H, H, bias=False)
        self.to(device=target.device, dtype=target.dtype)

    @classmethod
    def from_target(cls, target: Transformer, feature_layers=None, seed: int | None = None) -> "Drafter":
        """A randomly initialised drafter for `target`."""
        if seed is not None:
            torch.manual_seed(seed)
        drafter = cls(target, DrafterConfig.for_target(target, feature_layers))
        with torch.no_grad():
            for m in drafter.modules():
                if isinstance(m, nn.Linear):
                    # Drawn contiguous, then copied: the same drafter for a seed whatever the weights' layout.
                    w = m.weight
                    w.copy_(torch.empty(w.shape, dtype=w.dtype, device=w.device).normal_(std=0.02))
                    if m.bias is not None:
                        m.bias.zero_()
        return drafter

    def set_weight_bits(self, bits: int) -> None:
        """Draft on weights rounded to 4 bits (bits=4) or on the parameters' values (16). At 4 bits fc's and
        the layer's products, where tlt's CPU kernels run them, stream a quarter of the bytes of bf16 weights
        (tlt's bf16 kernels) or an eighth of float32 ones (its AVX2 float32 kernel): a drafter's forward over
        a few tokens is bound by streaming its weights (fc and the layer are about a tenth of a 12-layer
        policy's, and a depth-4 draft reads them four times a step). Weights that no tlt CPU kernel takes (on a
        GPU, float32 ones under PACK_MIN_BYTES or on AVX-512 CPUs, with TLT_CPU_KERNELS=0) stay as they are.
        Rounding changes only what is drafted: verification is the target's, so the samples stay those of plain decoding. Training reads the
        parameters, never the rounded copy."""
        self.layer.set_weight_bits(bits)
        self.weight_bits, self._fc = bits, Prepared()

    def new_cache(self, batch_size: int, **kwargs) -> KVCache:
        c = self.target.config
        kwargs.setdefault("dtype", cache_dtype(self.fc.weight.dtype, self.fc.weight.device, c.head_dim))
        kwargs.setdefault("device", self.fc.weight.device)
        return KVCache(1, batch_size, c.num_key_value_heads, c.head_dim, **kwargs)

    @property
    def output_layers(self) -> tuple[int, ...]:
        """Target layers whose outputs the drafter reads (empty: the last-layer feature only)."""
        return self.config.feature_layers or ()

    def target_features(self, hidden: torch.Tensor, layer_states: dict[int, torch.Tensor]) -> torch.Tensor:
        """The drafter's view f of a target forward's features: [..., H]."""
        if not self.config.feature_layers:
            return hidden
        return self.fuse(torch.cat([layer_states[i] for i in self.config.feature_layers], dim=-1))

    def forward(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache | None = None,
        tree_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairs (features [B, T, H] at t, tokens [B, T] at t+1) -> (f_hat [B, T, H], logits [B, T, V]).
        position_ids [B, T] are the features' positions t. Without a cache: causal attention over the T
        pairs (training; attention_mask marks real pairs, a position 0 starts a new packed sequence)."""
        target = self.target
        embedded = F.embedding(tokens, target.model.embed_tokens.weight.detach())  # [B, T, H], frozen
        x = inference_linear(self._fc, self.fc, torch.cat([embedded.to(features.dtype), features], dim=-1),
                             self.weight_bits)  # [B, T, H]
        B, T = tokens.shape
        if cache is None:
            mask = additive(training_mask(attention_mask, position_ids, B, T, x.device), x.dtype)
        else:
            mask = attention_mask_for(cache, T, tree_mask, attention_mask, mask_dtype(cache.dtype, cache.device))
        cos, sin = target.rope(position_ids, target.inv_freq, target.rope_scaling_factor, x.dtype)
        f_hat = self.layer(x, cos, sin, mask, cache, 0)  # [B, T, H], straight to the LM head
        if cache is not None:
            cache.advance(attention_mask.long().sum(1) if attention_mask is not None else T)
        # The LM head is the target's and frozen: no gradient may reach it from drafter training.
        if torch.is_grad_enabled():
            return f_hat, F.linear(f_hat, target.lm_head.weight.detach())
        return f_hat, target.head(f_hat)

    # --- persistence -------------------------------------------------------------------------------
    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}

    def save(self, directory: str | os.PathLike) -> None:
        from safetensors.torch import save

        from tlt.io import atomic_write_bytes, atomic_write_json

        folder = Path(directory)
        atomic_write_bytes(folder / "drafter.safetensors", save(self.trainable_state(), metadata={"format": "pt"}))
        atomic_write_json(folder / "drafter_config.json", asdict(self.config))

    @classmethod
    def load(cls, directory: str | os.PathLike, target: Transformer) -> "Drafter":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        from tlt.model.checkpoint import read_json

        folder = drafter_folder(directory)
        cfg_path = folder / "drafter_config.json"
        raw = read_json(cfg_path)
        try:
            if raw.get("feature_layers") is not None:
                raw["feature_layers"] = tuple(raw["feature_layers"])
            config = DrafterConfig(**raw)
        except TypeError as exc:
            raise CheckpointError(f"{cfg_path}: {exc}") from None
        config.check_target(target, str(cfg_path))
        weights = folder / "drafter.safetensors"
        if not weights.is_file():
            raise CheckpointError(f"{weights}: weights file is missing")
        try:
            state = load_file(str(weights))
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{weights}: cannot read safetensors weights ({exc})") from None
        drafter = cls(target, config)
        check_tensors(state, drafter.state_dict(), str(weights))
        drafter.load_state_dict({k: v.to(target.dtype) for k, v in state.items()})
        return drafter.eval()


# "default": trained on the default model's own samples; "references": the same recipe on the task's
# reference solutions, text the model did not write (the starting point of the drafter-alignment benchmark).
BUILTIN_DRAFTERS = {"default": Path(__file__).resolve().parent.parent / "assets" / "default" / "drafter",
                    "references": Path(__file__).resolve().parent.parent / "assets" / "default" / "drafter-references"}


def drafter_folder(name_or_folder: str | os.PathLike) -> Path:
    """The folder of a built-in drafter name ("bench": the bench policy's, built by `make bench-model`,
    tlt/bench_model.py), else the path itself."""
    name = str(name_or_folder)
    if name in BUILTIN_DRAFTERS:
        return BUILTIN_DRAFTERS[name]
    if name == "bench":
        from tlt.bench_model import drafter_folder as bench_drafter

        return bench_drafter()
    return Path(name_or_folder)

"""Model configuration for the built-in engine: Llama-family decoders (Llama, Qwen2).

Contract:
- `ModelConfig.from_hf_dict` reads an HF-style ``config.json`` dict (Llama or Qwen2 family) and raises
  `ValueError` naming the field for anything the engine cannot run faithfully (missing sizes, an
  unsupported architecture, activation, RoPE scaling or sliding window) instead of silently computing
  something else.
- `PRESETS` holds the random-init models: ``tiny`` (tests, demos) and ``small`` (CPU benchmarks). Their
  vocabularies cover the byte-level tokenizer, whose special ids they use for bos/eos.
- `to_hf_dict` writes the config back in HF form, so a preset can be instantiated by transformers with
  the same shapes (reference parity tests, benchmarks).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvherd.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB_SIZE

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str  # "llama" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v bias (never o)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "model config: num_attention_heads "
                f"({self.num_attention_heads}) is not a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.model_type not in _ARCHITECTURES:
            raise ValueError(f"model config: unsupported model_type {self.model_type!r}")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read an HF ``config.json`` dict; unsupported features raise `ValueError`."""
        model_type = d.get("model_type")
        if model_type not in _ARCHITECTURES:
            raise ValueError(
                f"model config: unsupported model_type {model_type!r} "
                f"(supported: {', '.join(sorted(_ARCHITECTURES))})"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"model config: unsupported hidden_act {act!r} (only 'silu')")
        if d.get("mlp_bias"):
            raise ValueError("model config: mlp_bias=true is not supported")
        if d.get("use_sliding_window"):
            raise ValueError("model config: sliding-window attention is not supported")
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if k not in d
        ]
        if missing:
            raise ValueError(f"model config: missing required field(s) {', '.join(missing)}")
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or (
            d["hidden_size"] // heads if isinstance(heads, int) and heads > 0 else 0
        )
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(d),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama only when attention_bias says so.
            attention_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            bos_token_id=_single_id(d.get("bos_token_id"), "bos_token_id"),
            eos_token_id=_single_id(d.get("eos_token_id"), "eos_token_id"),
            initializer_range=float(d.get("initializer_range", 0.02)),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` of this model (inverse of `from_hf_dict`)."""
        d = asdict(self)
        rope_theta = d.pop("rope_theta")
        d["architectures"] = [_ARCHITECTURES[self.model_type]]
        d["hidden_act"] = "silu"
        # Both spellings: transformers >= 5 reads rope_parameters, older versions rope_theta.
        d["rope_theta"] = rope_theta
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
        d["rope_scaling"] = None
        if self.model_type == "qwen2":
            d.pop("attention_bias")
            d["use_sliding_window"] = False
        return d


def _rope_theta(d: dict[str, Any]) -> float:
    """RoPE base from either spelling; any scaling other than the default is refused."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    for name, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        if spec is None:
            continue
        if not isinstance(spec, dict):
            raise ValueError(f"model config: {name} must be an object or null, got {spec!r}")
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise ValueError(
                f"model config: {name} rope_type {kind!r} is not supported (only default RoPE)"
            )
    theta = d.get("rope_theta")
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    return float(theta if theta is not None else 10000.0)


def _single_id(value: Any, name: str) -> int | None:
    # Some checkpoints list several eos ids; the first is the one generation stops on.
    if isinstance(value, list):
        value = value[0] if value else None
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"model config: {name} must be an integer, got {value!r}")
    return value


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        model_type="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        bos_token_id=BYTE_BOS_ID,
        eos_token_id=BYTE_EOS_ID,
    ),
    "small": ModelConfig(
        model_type="llama",
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=BYTE_BOS_ID,
        eos_token_id=BYTE_EOS_ID,
    ),
}
assert all(c.vocab_size >= BYTE_VOCAB_SIZE for c in PRESETS.values())

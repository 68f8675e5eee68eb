"""The model a served target runs: a tiny Llama that kvcert makes itself, so nothing comes from a model hub.

Its config is small enough for two CPU cores (hidden 128, 2 layers, 4 heads of 32, 2 KV heads), its
weights are drawn from a seed with a wide normal (std 0.5: logits far apart, so greedy decoding rarely
meets a tie), and its tokenizer is a byte-level BPE trained here on text drawn from the same seed. The
same seed gives the same files, byte for byte (`digest`), in any process: a served run names the model
by its digest, and a replay file carries it.

What it needs (torch, transformers, tokenizers, safetensors) is in every engine environment kvcert
builds; it imports them only when a model is made.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["ModelSpec", "digest", "ensure_model", "model_root"]

MODEL_HOME_ENV = "KVCERT_MODEL_HOME"
"""Where made models are kept (default `~/.cache/kvcert/models`); one folder per spec, reused when its digest
matches."""

_WORDS = (
    "cache page token prefix radix tree host device load back evict insert match lock session turn agent tool "
    "call pause priority high low request prompt output batch decode prefill block hash parent child event "
    "store remove memory pool slot write through back copy stream server client router scheduler engine model"
).split()


@dataclass(frozen=True)
class ModelSpec:
    """What decides a made model's bytes."""

    seed: int = 0
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    max_positions: int = 2048
    weight_std: float = 0.5
    sliding_window: int = 0
    """> 0: every other layer (the second, fourth, ...) attends to the last `sliding_window` tokens only, declared
    per layer in the config (`layer_types`): a hybrid model, one full-attention and one sliding-window KV group in
    vLLM's hybrid manager; 0: full attention throughout."""

    @property
    def name(self) -> str:
        kind = f"hybrid-swa{self.sliding_window}" if self.sliding_window else "llama"
        return f"kvcert-tiny-{kind}-s{self.seed}"


def model_root() -> Path:
    return Path(os.environ.get(MODEL_HOME_ENV) or Path.home() / ".cache" / "kvcert" / "models")


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 24))) for _ in range(lines)]


def _tokenizer(spec: ModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", clean_up_tokenization_spaces=False
    )
    # a chat template, so the OpenAI chat endpoints serve too: turns joined plainly
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(out)


def _weights(spec: ModelSpec, out: Path, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.hidden_size // spec.heads,
        max_position_embeddings=spec.max_positions,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    config = LlamaConfig(**common)
    if spec.sliding_window:  # vLLM's Llama reads per-layer attention from `layer_types` (model_executor/models/llama.py)
        config.layer_types = ["full_attention" if i % 2 == 0 else "sliding_attention" for i in range(spec.layers)]
        config.sliding_window = spec.sliding_window
    model: Any = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * spec.weight_std)
    model.save_pretrained(out, safe_serialization=True)


def digest(folder: Path) -> str:
    """SHA-256 over every file's name and bytes, in name order: two folders with one digest serve one model."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "kvcert-model.json"):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def _toolchain() -> str:
    """The versions that write the files (transformers, tokenizers): each environment keeps its own copy."""
    import tokenizers
    import transformers

    return f"tf{transformers.__version__}-tk{tokenizers.__version__}"


def ensure_model(spec: ModelSpec = ModelSpec(), root: Path | None = None) -> tuple[Path, str]:
    """The model's folder and digest, made if missing (or if a folder of that name holds other bytes)."""
    folder = (root or model_root()) / f"{spec.name}-{_toolchain()}"
    stamp = folder / "kvcert-model.json"
    if stamp.exists():
        saved = json.loads(stamp.read_text())
        if saved.get("spec") == asdict(spec) and saved.get("digest") == digest(folder):
            return folder, saved["digest"]
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for old in tmp.iterdir():
        old.unlink()
    _tokenizer(spec, tmp)
    vocab = len(json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"])
    _weights(spec, tmp, max(vocab, spec.vocab_size))
    made = digest(tmp)
    (tmp / "kvcert-model.json").write_text(json.dumps({"spec": asdict(spec), "digest": made}, indent=1))
    if folder.exists():
        for old in folder.iterdir():
            old.unlink()
        folder.rmdir()
    tmp.rename(folder)
    return folder, made


def main(argv: list[str] | None = None) -> None:
    """`python -m kvcert.conformance.served.model --seed S [--sliding-window W]`: make (or find) the model in this
    environment and print {"path", "digest", "spec"} as JSON (a served run calls it with the engine's interpreter)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sliding-window", type=int, default=0)
    parser.add_argument("--root", type=Path, default=None)
    args = parser.parse_args(argv)
    spec = ModelSpec(seed=args.seed, sliding_window=args.sliding_window)
    path, made = ensure_model(spec, args.root)
    print(json.dumps({"path": str(path), "digest": made, "spec": asdict(spec)}))


if __name__ == "__main__":
    main()

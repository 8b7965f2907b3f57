"""Tokenizers: the byte tokenizer and its chat template, the HF wrapper, streaming detokenization."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvherd.chat_render import parse_chat
from kvherd.tokenizer import (
    BYTE_EOS_ID,
    BYTE_VOCAB_SIZE,
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    chat_token_ids,
    load_tokenizer,
)

TEXT = "héllo wörld 🙂 — ok"


def test_byte_round_trip_and_specials() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    assert tok.encode("a<|eos|>b") == [97, BYTE_EOS_ID, 98]
    # Special ids and ids past the vocabulary (a random model emits them) decode to nothing.
    assert tok.decode([97, BYTE_EOS_ID, 400, 98]) == "ab"
    assert tok.decode([0xFF]) == "\ufffd"
    assert tok.vocab_size == BYTE_VOCAB_SIZE == 263 and tok.eos_token_id == 257


def test_byte_chat_template() -> None:
    tok = ByteTokenizer()
    prompt = parse_chat(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}],
                },
            ]
        }
    )
    text = tok.render_chat(prompt)
    assert text == "<|system|>\nBe brief.<|end|>\n<|user|>\nHi\n!<|end|>\n<|assistant|>\n"
    ids = chat_token_ids(tok, prompt)
    assert ids == tok.encode(text)
    assert ids[0] == 256 + 3 and ids.count(256 + 6) == 2 and ids[-2:] == [256 + 5, 10]


def test_incremental_byte_detokenizer_holds_split_characters() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in tok.encode(TEXT)]
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[1] == "" and deltas[2] == "é"  # é is two bytes: held until complete
    cut = IncrementalDetokenizer(tok)
    assert cut.push([0xF0, 0x9F]) == "" and cut.flush() == "\ufffd"


def _save_hf_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator([TEXT, "hello world, hello kv cache"] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf_tok")
    _save_hf_tokenizer(path)
    return path


def test_hf_tokenizer_wrapper(hf_tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(hf_tokenizer_dir))
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert tok.eos_token_id == 1 and tok.vocab_size <= 320
    # No chat template shipped: the byte tokenizer's documented format.
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}]})
    assert tok.render_chat(chat).startswith("<|user|>\nx")
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert streamed == TEXT


def test_checkpoint_with_tokenizer_files_uses_them(
    hf_checkpoints: dict[str, Path], hf_tokenizer_dir: Path, tmp_path: Path
) -> None:
    from instance_agent.engine.loader import load_model

    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoints["llama"], ckpt)
    for f in hf_tokenizer_dir.iterdir():
        shutil.copy(f, ckpt / f.name)
    assert isinstance(load_model(str(ckpt), device="cpu").tokenizer, HFTokenizer)
    assert isinstance(
        load_model(str(hf_checkpoints["llama"]), device="cpu").tokenizer, ByteTokenizer
    )


def test_tokenizer_module_is_torch_free() -> None:
    code = (
        "import sys, kvherd.tokenizer as t; t.ByteTokenizer().encode('x'); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

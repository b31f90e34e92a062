"""Data preparation for the demo model: byte-level BPE tokenizer and tokenized train/valid splits."""

from __future__ import annotations

import json
import os

import numpy as np
from demo_data import DOC_SEP
from demo_model.common import atomic_write_json

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(train_txt: str, out_dir: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with open(train_txt, encoding="utf-8") as fh:
        docs = fh.read().split("\n" + DOC_SEP + "\n")
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    finalize_tokenizer_files(out_dir)


def finalize_tokenizer_files(out_dir: str) -> None:
    """Make tokenizer_config.json self-contained and loadable by older transformers too:
    the ChatML template lives in it (not in a separate chat_template.jinja), the class is the
    generic PreTrainedTokenizerFast, special tokens are listed the classic way. Idempotent."""
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    jinja = os.path.join(out_dir, "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.pop("extra_special_tokens", None)
    cfg["additional_special_tokens"] = extra or ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    cfg.pop("backend", None)
    atomic_write_json(path, cfg)


def load_hf_tokenizer(out_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out_dir)


def tokenize_file(tok, path: str, dst: str) -> np.ndarray:
    if os.path.exists(dst):
        return np.fromfile(dst, dtype=np.uint16)
    sep_id = tok.convert_tokens_to_ids(DOC_SEP)
    with open(path, encoding="utf-8") as fh:
        docs = fh.read().split("\n" + DOC_SEP + "\n")
    ids: list[int] = []
    for doc in docs:
        ids.extend(tok.encode(doc, add_special_tokens=False))
        ids.append(sep_id)
    arr = np.asarray(ids, dtype=np.uint16)
    arr.tofile(dst + ".tmp")
    os.replace(dst + ".tmp", dst)
    return arr

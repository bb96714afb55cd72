"""A character-level tokenizer for the built-in task, saved and loaded as a Hugging Face tokenizer.

Built with the ``tokenizers`` library and wrapped in ``PreTrainedTokenizerFast``, so a built-in
checkpoint directory loads with ``AutoTokenizer`` exactly like any other Hugging Face causal LM.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from models.builtin import addition

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]


def build_char_tokenizer(characters: str | list[str] = addition.CHARACTERS) -> Any:
    """pad/bos/eos/unk, then one token per character (by default 16 tokens: ten digits, ``+`` and ``=``).
    Prompts get a BOS prepended. Another task passes its own characters; their order fixes the ids."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(characters))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )

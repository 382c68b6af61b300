"""Train the embedded base's tokenizer: byte-level BPE on the environments' own text.

Why train one: the pipeline must run offline with no hub download, and a vocabulary fitted to tool names, JSON
framing and instructions keeps sequences short for a tiny model on a CPU. A number or a word is always a piece
of its own, never merged with the punctuation or space around it, so a copied name, id or amount is the same
token(s) wherever it appears. The result is a standard `PreTrainedTokenizerFast` with the chat template and the
tool-call/experience special tokens, saved next to the model so `AutoTokenizer.from_pretrained` loads it.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lopd_core.model.chat import CHAT_TEMPLATE, IM_END, PAD, SPECIAL_TOKENS


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            # A word is always a token sequence of its own, never merged with the space or the quote before
            # it: `Rosa` in an instruction and in `{"owner": "Rosa"}` is the same token, so the policy can copy
            # names, ids and tool names by attention instead of learning a mapping between spellings. Runs of
            # punctuation and spaces (`", `, `"}}`) merge freely, so a tool call stays short.
            # A JSON key with its quotes, colon, space and opening quote (`"owner": "`) is one piece: the token
            # right before a value then names the slot by itself, so copying the value into it is one
            # attention hop (not two: "which key came before this `": "`?", then "find that value"), and the
            # same key in an experience is the same token, which induction can match (what it bought:
            # docs/experiments/2026-12-05-base-design-figures.md).
            pre_tokenizers.Split(Regex(r"\"[A-Za-z_]+\": ?\"?|[A-Za-z][A-Za-z_]*"), behavior="isolated"),
            # A newline is always a token of its own, so turn framing (`user` `\n`) ends on a token boundary
            # whatever follows: the latent teacher splices its latents there into the student's ids.
            pre_tokenizers.Split("\n", behavior="isolated"),
            # A number is a piece of its own (`a71` -> `a` `71`) that BPE may keep whole: copying an id or an
            # amount from an observation is then copying one or two tokens, which a tiny model learns far
            # sooner than a digit-by-digit chain.
            pre_tokenizers.Digits(individual_digits=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token=PAD,
        eos_token=IM_END,  # generation of one assistant turn stops at <|im_end|>
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (PAD, IM_END)],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 1 << 20
    return tokenizer
